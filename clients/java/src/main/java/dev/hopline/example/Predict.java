package dev.hopline.example;

import hopline.gateway.v1.Gateway.PredictRequest;
import hopline.gateway.v1.Gateway.PredictResponse;
import hopline.gateway.v1.GatewayServiceGrpc;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import java.util.concurrent.TimeUnit;

/**
 * Calls hopline's gateway once, with a deadline, and prints the answer and the trace id to look
 * the request up in Jaeger. With HOPLINE_API_KEY set it sends that key (a gateway with
 * HOPLINE_API_KEYS needs one; the key names the tenant).
 *
 * <p>Usage: {@code java -cp ... dev.hopline.example.Predict [addr] [text] [timeout-ms]}
 */
public final class Predict {
  private Predict() {}

  public static void main(String[] args) throws InterruptedException {
    String addr = args.length > 0 ? args[0] : "127.0.0.1:8001";
    String text = args.length > 1 ? args[1] : "where is my order";
    long timeoutMs = args.length > 2 ? Long.parseLong(args[2]) : 5000;

    ManagedChannel channel = ManagedChannelBuilder.forTarget(addr).usePlaintext().build();
    Metadata headers = new Metadata();
    String key = System.getenv("HOPLINE_API_KEY");
    if (key != null && !key.isEmpty()) {
      headers.put(
          Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + key);
    }
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
      System.err.printf(
          "predict failed: %s: %s%n", e.getStatus().getCode(), e.getStatus().getDescription());
      System.exit(1);
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
  }
}
