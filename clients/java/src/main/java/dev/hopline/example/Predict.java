package dev.hopline.example;

import hopline.gateway.v1.Gateway.PredictRequest;
import hopline.gateway.v1.Gateway.PredictResponse;
import hopline.gateway.v1.GatewayServiceGrpc;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Calls hopline's gateway once, with a deadline, and prints the answer and the trace id to look
 * the request up in Jaeger. With HOPLINE_API_KEY set it sends that key (a gateway with
 * HOPLINE_API_KEYS needs one; the key names the tenant).
 *
 * <p>Usage: {@code java -cp ... dev.hopline.example.Predict [addr] [text] [timeout-ms]}
 *
 * <p>Exit status: 0 answered, 1 the call failed (its gRPC status on stderr), 2 a usage mistake
 * (one line on stderr, nothing sent).
 */
public final class Predict {
  private static final String USAGE = "usage: Predict [addr] [text] [timeout-ms]";
  private static final String KEY_RULE =
      "an API key must be printable ASCII with no spaces around it"
          + " (it is sent as 'authorization: Bearer <key>')";
  private static final Pattern PORT = Pattern.compile(":([0-9]+)$");

  private Predict() {}

  /** Says what is wrong with how the command was called, in one line, and exits 2. */
  private static void usageError(String message) {
    System.err.println("predict: error: " + message);
    System.exit(2);
  }

  private static long timeoutMs(String raw) {
    if (raw.matches("[0-9]{1,18}") && Long.parseLong(raw) > 0) {
      return Long.parseLong(raw);
    }
    usageError("timeout-ms must be a whole number of milliseconds above 0, got \"" + raw + "\"");
    return 0;
  }

  private static ManagedChannel channel(String addr) {
    // grpc-java checks a port's range only as it resolves, on a thread of its own (a stack
    // trace, then the deadline): said here instead.
    Matcher port = PORT.matcher(addr);
    if (port.find() && (port.group(1).length() > 5 || Integer.parseInt(port.group(1)) > 65535)) {
      usageError("address \"" + addr + "\": port out of range");
    }
    try {
      return ManagedChannelBuilder.forTarget(addr).usePlaintext().build();
    } catch (IllegalArgumentException e) { // a target it cannot parse
      usageError("address \"" + addr + "\": " + e.getMessage());
      return null;
    }
  }

  private static String describe(Status status, String addr) {
    StringBuilder line = new StringBuilder("predict failed: ").append(status.getCode());
    if (status.getDescription() != null) {
      line.append(": ").append(status.getDescription());
    }
    // A failure to connect is "io exception": what failed is in the cause.
    if (status.getCause() != null && status.getCause().getMessage() != null) {
      line.append(": ").append(status.getCause().getMessage());
    }
    if (status.getCode() == Status.Code.UNAVAILABLE) {
      line.append(" (gateway address ").append(addr).append(')');
    }
    return line.toString();
  }

  public static void main(String[] args) throws InterruptedException {
    if (args.length > 3) {
      usageError("too many arguments: " + USAGE);
    }
    String addr = args.length > 0 ? args[0] : "127.0.0.1:8001";
    String text = args.length > 1 ? args[1] : "where is my order";
    long timeoutMs = args.length > 2 ? timeoutMs(args[2]) : 5000;
    String key = System.getenv().getOrDefault("HOPLINE_API_KEY", "").strip();
    // Metadata's ASCII marshaller would send other characters mangled, not refuse them.
    if (!key.chars().allMatch(c -> c >= 0x20 && c <= 0x7e)) {
      usageError("HOPLINE_API_KEY: " + KEY_RULE);
    }

    ManagedChannel channel = channel(addr);
    Metadata headers = new Metadata();
    if (!key.isEmpty()) {
      headers.put(
          Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + key);
    }
    int exit = 0;
    try {
      PredictResponse reply =
          GatewayServiceGrpc.newBlockingStub(channel)
              .withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers))
              .withDeadlineAfter(timeoutMs, TimeUnit.MILLISECONDS)
              .predict(PredictRequest.newBuilder().setText(text).build());
      System.out.printf(
          "label=%s score=%.4f model=%s/%s cache=%s trace_id=%s%n",
          reply.getPrediction().getLabel(),
          reply.getPrediction().getScore(),
          reply.getModel(),
          reply.getModelVersion(),
          reply.getCache().getOutcome().name(),
          reply.getTraceId());
    } catch (StatusRuntimeException e) {
      System.err.println(describe(e.getStatus(), addr));
      exit = 1;
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
    System.exit(exit);
  }
}
