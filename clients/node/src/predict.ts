// Calls hopline's gateway once, with a deadline, and prints the answer and the trace id to
// look the request up in Jaeger. With HOPLINE_API_KEY set it sends that key (a gateway with
// HOPLINE_API_KEYS needs one; the key names the tenant).
//
//   node dist/src/predict.js [addr] [text] [timeout-ms]
import { credentials, Metadata, ServiceError, status } from "@grpc/grpc-js";

import { cacheOutcomeToJSON } from "../gen/hopline/common/v1/common";
import { GatewayServiceClient, PredictRequest } from "../gen/hopline/gateway/v1/gateway";

const [addr = "127.0.0.1:8001", text = "where is my order", timeoutMs = "5000"] =
  process.argv.slice(2);

const client = new GatewayServiceClient(addr, credentials.createInsecure());
const request = PredictRequest.fromPartial({ text });
const deadline = new Date(Date.now() + Number(timeoutMs));
const metadata = new Metadata();
if (process.env.HOPLINE_API_KEY) {
  metadata.set("authorization", `Bearer ${process.env.HOPLINE_API_KEY}`);
}

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
