// Calls hopline's gateway once, with a deadline, and prints the answer and the trace id to
// look the request up in Jaeger. With HOPLINE_API_KEY set it sends that key (a gateway with
// HOPLINE_API_KEYS needs one; the key names the tenant).
//
//   node dist/src/predict.js [addr] [text] [timeout-ms]
//
// Exit status: 0 answered, 1 the call failed (its gRPC status on stderr), 2 a usage mistake
// (one line on stderr, nothing sent).
import { credentials, Metadata, ServiceError, status } from "@grpc/grpc-js";

import { cacheOutcomeToJSON } from "../gen/hopline/common/v1/common";
import { GatewayServiceClient, PredictRequest } from "../gen/hopline/gateway/v1/gateway";

const KEY_RULE =
  "an API key must be printable ASCII with no spaces around it " +
  "(it is sent as 'authorization: Bearer <key>')";

/** Says what is wrong with how the command was called, in one line, and exits 2. */
function usageError(message: string): never {
  console.error(`predict: error: ${message}`);
  process.exit(2);
}

const args = process.argv.slice(2);
if (args.length > 3) {
  usageError("too many arguments: usage: predict.js [addr] [text] [timeout-ms]");
}
const [addr = "127.0.0.1:8001", text = "where is my order", timeoutMs = "5000"] = args;

const ms = /^[0-9]+$/.test(timeoutMs) ? Number(timeoutMs) : 0;
const deadline = new Date(Date.now() + ms); // Invalid Date past JavaScript's last date
if (!(ms > 0) || Number.isNaN(deadline.getTime())) {
  usageError(`timeout-ms must be a whole number of milliseconds above 0, got "${timeoutMs}"`);
}
// Refused here, not thrown by grpc-js's Metadata as "contains illegal characters".
const key = (process.env.HOPLINE_API_KEY ?? "").trim();
if (!/^[\x20-\x7e]*$/.test(key)) {
  usageError(`HOPLINE_API_KEY: ${KEY_RULE}`);
}
const metadata = new Metadata();
if (key) {
  metadata.set("authorization", `Bearer ${key}`);
}

let client: GatewayServiceClient;
try {
  client = new GatewayServiceClient(addr, credentials.createInsecure());
} catch (err) {
  // a target grpc-js cannot parse
  usageError(`address "${addr}": ${(err as Error).message}`);
}
const request = PredictRequest.fromPartial({ text });

client.predict(request, metadata, { deadline }, (err: ServiceError | null, reply) => {
  client.close();
  if (err) {
    console.error(`predict failed: ${status[err.code]}: ${err.details}`);
    process.exit(1);
  }
  const p = reply.prediction;
  console.log(
    `label=${p?.label} score=${p?.score.toFixed(4)} model=${reply.model}/${reply.modelVersion} ` +
      `cache=${cacheOutcomeToJSON(reply.cache?.outcome ?? 0)} trace_id=${reply.traceId}`,
  );
});
