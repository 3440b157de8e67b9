// Calls hopline's gateway once, with a deadline, and prints the answer and the trace id to
// look the request up in Jaeger. With HOPLINE_API_KEY set it sends that key (a gateway with
// HOPLINE_API_KEYS needs one; the key names the tenant). With HOPLINE_TLS_CA set (a PEM CA
// file) it dials over TLS and verifies the gateway's certificate against that CA; unset,
// plaintext.
//
//   node dist/src/predict.js [addr] [text] [timeout-ms]
//
// Exit status: 0 answered, 1 the call failed (its gRPC status on stderr), 2 a usage mistake
// (one line on stderr, nothing sent).
import { X509Certificate } from "node:crypto";
import { readFileSync } from "node:fs";

import { ChannelCredentials, credentials, Metadata, ServiceError, status } from "@grpc/grpc-js";

import { cacheOutcomeToJSON } from "../gen/hopline/common/v1/common";
import { GatewayServiceClient, PredictRequest } from "../gen/hopline/gateway/v1/gateway";

const KEY_RULE =
  "an API key must be printable ASCII with no spaces around it " +
  "(it is sent as 'authorization: Bearer <key>')";
const CA_ENV = "HOPLINE_TLS_CA";
const LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
const HOST_NAME = new RegExp(`^${LABEL}(\\.${LABEL})*\\.?$`);

/** Says what is wrong with how the command was called, in one line, and exits 2. */
function usageError(message: string): never {
  console.error(`predict: error: ${message}`);
  process.exit(2);
}

/**
 * What is wrong with `addr`, or "" for a host:port the example dials: a name or an IPv4
 * address, or an IPv6 address in brackets, then a port from 1 to 65535. The same rule as the
 * Go and Java examples; grpc-js would take some of these as a target to resolve and fail each
 * call instead (UNAVAILABLE "Failed to parse DNS address", "Port should be >= 0 and < 65536").
 */
function addressProblem(addr: string): string {
  const give = "give host:port, as 127.0.0.1:8001";
  if (addr === "") {
    return `empty: ${give}`;
  }
  if (addr.includes("://")) {
    return `a URL, not an address: ${give}`;
  }
  let host: string;
  let port: string;
  if (addr.startsWith("[")) {
    const end = addr.indexOf("]");
    if (end < 0) {
      return "no ']' closes the IPv6 address: give [address]:port, as [::1]:8001";
    }
    host = addr.slice(1, end);
    port = addr.slice(end + 1);
    if (!port.startsWith(":")) {
      return "no :port after the ']': give [address]:port, as [::1]:8001";
    }
    port = port.slice(1);
    if (!/^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?$/.test(host)) {
      return `[${host}] is not an IPv6 address`;
    }
  } else {
    const colon = addr.lastIndexOf(":");
    if (colon < 0) {
      return `no port: ${give}`;
    }
    host = addr.slice(0, colon);
    port = addr.slice(colon + 1);
    if (host.includes(":")) {
      return "an IPv6 address goes in brackets, as [::1]:8001";
    }
    if (host === "") {
      return `no host before the ':': ${give}`;
    }
    // An IPv4 address or a DNS name: labels of letters, digits and inner hyphens.
    if (!HOST_NAME.test(host)) {
      return `host "${host}" is not a name or an IP address`;
    }
  }
  if (port === "") {
    return `no port after the ':': ${give}`;
  }
  if (!/^[0-9]{1,5}$/.test(port) || Number(port) < 1 || Number(port) > 65535) {
    return `port "${port}" is not a number from 1 to 65535`;
  }
  return "";
}

/** Plaintext, or TLS verifying the gateway against the CA file in HOPLINE_TLS_CA. */
function channelCredentials(ca: string): ChannelCredentials {
  if (!ca) {
    return credentials.createInsecure();
  }
  let pem: Buffer;
  try {
    pem = readFileSync(ca);
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    // "ENOENT: no such file or directory", without ", open '<path>'" (named already)
    usageError(`${CA_ENV}="${ca}": cannot read it: ${e.message.split(",")[0]}`);
  }
  // createSsl takes PEM only, and takes a file without a certificate silently (the handshake
  // then fails "unable to verify the first certificate"); X509Certificate also parses DER.
  const first = /-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----/.exec(pem.toString("latin1"));
  try {
    new X509Certificate(first?.[0] ?? "");
  } catch {
    usageError(`${CA_ENV}="${ca}" holds no PEM certificate`);
  }
  // grpc-js sends an IP address as the TLS server name too, which Node warns of on stderr
  // (DEP0123) on every call to 127.0.0.1; the certificate is checked against it all the same.
  const emitWarning = process.emitWarning.bind(process) as (...args: unknown[]) => void;
  process.emitWarning = ((...args: unknown[]) => {
    if (!args.includes("DEP0123")) {
      emitWarning(...args);
    }
  }) as typeof process.emitWarning;
  // The gateway's certificate must name the host dialled (make certs's name 127.0.0.1 and
  // localhost beside gateway).
  return credentials.createSsl(pem);
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
// Refused here, not thrown by grpc-js's Metadata as "contains illegal characters". Only
// ASCII white space is trimmed, as the other clients do: a key ending in a no-break space is
// not printable ASCII.
const key = (process.env.HOPLINE_API_KEY ?? "").replace(/^[ \t\r\n]+|[ \t\r\n]+$/g, "");
if (!/^[\x20-\x7e]*$/.test(key)) {
  usageError(`HOPLINE_API_KEY: ${KEY_RULE}`);
}
const metadata = new Metadata();
if (key) {
  metadata.set("authorization", `Bearer ${key}`);
}

const problem = addressProblem(addr);
if (problem) {
  usageError(`address "${addr}": ${problem}`);
}
const ca = process.env[CA_ENV] ?? "";
const over = ca ? `TLS with ${CA_ENV}=${ca}` : "plaintext";
const channel = channelCredentials(ca);

let client: GatewayServiceClient;
try {
  client = new GatewayServiceClient(addr, channel);
} catch (err) {
  // a target grpc-js cannot parse
  usageError(`address "${addr}": ${(err as Error).message}`);
}
const request = PredictRequest.fromPartial({ text });

client.predict(request, metadata, { deadline }, (err: ServiceError | null, reply) => {
  client.close();
  if (err) {
    // grpc-js ends a failure to connect with "Resolution note: " and nothing after it.
    const details = err.details.replace(/\.? Resolution note: $/, "").trim();
    let line = `predict failed: ${status[err.code]}: ${details}`;
    // No trailers: no gateway answered (its own errors carry x-hopline-trace-id).
    const answered = Object.keys(err.metadata?.getMap() ?? {}).length > 0;
    if (!answered && (err.code === status.UNAVAILABLE || err.code === status.DEADLINE_EXCEEDED)) {
      line += ` (gateway address ${addr} over ${over}`;
      // A TLS server closes a plaintext connection before HTTP/2 starts: grpc-js says only
      // "Failed to connect", where a refused connection says ECONNREFUSED.
      if (!ca && /Last error: Failed to connect/.test(err.details)) {
        line += `; closed before HTTP/2 began, as a TLS gateway does: set ${CA_ENV} to its CA file`;
      }
      line += ")";
    }
    console.error(line.replace(/\n/g, " "));
    process.exit(1);
  }
  const p = reply.prediction;
  console.log(
    `label=${p?.label} score=${p?.score.toFixed(4)} model=${reply.model}/${reply.modelVersion} ` +
      `cache=${cacheOutcomeToJSON(reply.cache?.outcome ?? 0)} trace_id=${reply.traceId}`,
  );
});
