package dev.hopline.example;

import hopline.gateway.v1.Gateway.PredictRequest;
import hopline.gateway.v1.Gateway.PredictResponse;
import hopline.gateway.v1.GatewayServiceGrpc;
import io.grpc.ChannelCredentials;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.TlsChannelCredentials;
import io.grpc.stub.MetadataUtils;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.InvalidPathException;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.security.GeneralSecurityException;
import java.security.cert.CertificateFactory;
import java.util.concurrent.TimeUnit;
import java.util.logging.Level;
import java.util.logging.Logger;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Calls hopline's gateway once, with a deadline, and prints the answer and the trace id to look
 * the request up in Jaeger. With HOPLINE_API_KEY set it sends that key (a gateway with
 * HOPLINE_API_KEYS needs one; the key names the tenant). With HOPLINE_TLS_CA set (a PEM CA file)
 * it dials over TLS and verifies the gateway's certificate against that CA; unset, plaintext.
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
  private static final String CA_ENV = "HOPLINE_TLS_CA";
  // An IPv4 address or a DNS name: labels of letters, digits and inner hyphens.
  private static final String LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
  private static final Pattern HOST_NAME = Pattern.compile(LABEL + "(\\." + LABEL + ")*\\.?");
  private static final Pattern IPV6 =
      Pattern.compile("[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?");
  private static final Pattern PEM_CERTIFICATE =
      Pattern.compile("-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----");
  private static final Pattern PORT = Pattern.compile("[0-9]{1,5}");
  // grpc-java logs a failed name resolution as a WARNING with a stack trace on stderr, before
  // the call fails with the same cause (said in one line below). Held here: java.util.logging
  // keeps loggers weakly, and a collected one would forget its level.
  private static final Logger GRPC_LOG = Logger.getLogger("io.grpc");

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

  /**
   * What is wrong with {@code addr}, or null for a host:port the example dials: a name or an IPv4
   * address, or an IPv6 address in brackets, then a port from 1 to 65535. The same rule as the
   * Go and Node examples; grpc-java would dial "127.0.0.1:" on port 80, and check a port's range
   * only as it resolves, on a thread of its own (a stack trace, then the deadline).
   */
  static String addressProblem(String addr) {
    String give = "give host:port, as 127.0.0.1:8001";
    if (addr.isEmpty()) {
      return "empty: " + give;
    }
    if (addr.contains("://")) {
      return "a URL, not an address: " + give;
    }
    String host;
    String port;
    if (addr.startsWith("[")) {
      int end = addr.indexOf(']');
      if (end < 0) {
        return "no ']' closes the IPv6 address: give [address]:port, as [::1]:8001";
      }
      host = addr.substring(1, end);
      port = addr.substring(end + 1);
      if (!port.startsWith(":")) {
        return "no :port after the ']': give [address]:port, as [::1]:8001";
      }
      port = port.substring(1);
      if (!IPV6.matcher(host).matches()) {
        return "[" + host + "] is not an IPv6 address";
      }
    } else {
      int colon = addr.lastIndexOf(':');
      if (colon < 0) {
        return "no port: " + give;
      }
      host = addr.substring(0, colon);
      port = addr.substring(colon + 1);
      if (host.contains(":")) {
        return "an IPv6 address goes in brackets, as [::1]:8001";
      }
      if (host.isEmpty()) {
        return "no host before the ':': " + give;
      }
      if (!HOST_NAME.matcher(host).matches()) {
        return "host \"" + host + "\" is not a name or an IP address";
      }
    }
    if (port.isEmpty()) {
      return "no port after the ':': " + give;
    }
    if (!PORT.matcher(port).matches()
        || Integer.parseInt(port) < 1
        || Integer.parseInt(port) > 65535) {
      return "port \"" + port + "\" is not a number from 1 to 65535";
    }
    return null;
  }

  /** Plaintext, or TLS verifying the gateway against the CA file in HOPLINE_TLS_CA. */
  private static ChannelCredentials credentials(String ca) {
    if (ca.isEmpty()) {
      return InsecureChannelCredentials.create();
    }
    String named = CA_ENV + "=\"" + ca + "\"";
    byte[] pem = null;
    try {
      pem = Files.readAllBytes(Path.of(ca));
    } catch (NoSuchFileException e) {
      usageError(named + ": cannot read it: no such file");
    } catch (IOException | InvalidPathException | SecurityException e) {
      usageError(named + ": cannot read it: " + e);
    }
    // The certificates alone, in PEM, as the Go and Node clients take them: a key before them
    // made the parser give up, and it also reads DER, which they refuse.
    StringBuilder certificates = new StringBuilder();
    Matcher block = PEM_CERTIFICATE.matcher(new String(pem, StandardCharsets.ISO_8859_1));
    while (block.find()) {
      certificates.append(block.group()).append('\n');
    }
    byte[] only = certificates.toString().getBytes(StandardCharsets.ISO_8859_1);
    try {
      if (only.length == 0
          || CertificateFactory.getInstance("X.509")
              .generateCertificates(new ByteArrayInputStream(only))
              .isEmpty()) {
        usageError(named + " holds no PEM certificate");
      }
      // The gateway's certificate must name the host dialled (make certs's name 127.0.0.1 and
      // localhost beside gateway).
      return TlsChannelCredentials.newBuilder()
          .trustManager(new ByteArrayInputStream(only))
          .build();
    } catch (GeneralSecurityException | IOException e) {
      usageError(named + " holds no PEM certificate");
      return null;
    }
  }

  private static ManagedChannel channel(String addr, ChannelCredentials credentials) {
    try {
      return Grpc.newChannelBuilder(addr, credentials).build();
    } catch (IllegalArgumentException e) { // a target it cannot parse
      usageError("address \"" + addr + "\": " + e.getMessage());
      return null;
    }
  }

  private static String describe(StatusRuntimeException e, String addr, String over) {
    Status status = e.getStatus();
    StringBuilder line = new StringBuilder("predict failed: ").append(status.getCode());
    if (status.getDescription() != null) {
      line.append(": ").append(status.getDescription());
    }
    // A failure to connect is "io exception": what failed is in the cause, and a failed TLS
    // handshake's reason ("unable to find valid certification path") in the cause's root.
    Throwable cause = status.getCause();
    if (cause != null && cause.getMessage() != null) {
      line.append(": ").append(cause.getMessage());
      Throwable root = cause;
      while (root.getCause() != null && root.getCause() != root) {
        root = root.getCause();
      }
      if (root != cause && root.getMessage() != null
          && !cause.getMessage().contains(root.getMessage())) {
        line.append(": ").append(root.getMessage());
      }
    }
    // No trailers: no gateway answered (its own errors carry x-hopline-trace-id).
    Metadata trailers = e.getTrailers();
    boolean answered = trailers != null && !trailers.keys().isEmpty();
    // An HTTP/1 server answers with a status line, which grpc-java reads as a first frame that
    // is not SETTINGS and ends INTERNAL: no gateway answered that either.
    String said = String.valueOf(status.getDescription());
    boolean notHttp2 = line.indexOf("First received frame was not SETTINGS") >= 0;
    if (!answered
        && (notHttp2
            || status.getCode() == Status.Code.UNAVAILABLE
            || status.getCode() == Status.Code.DEADLINE_EXCEEDED)) {
      line.append(" (gateway address ").append(addr).append(" over ").append(over);
      if (notHttp2) {
        line.append("; the server there answered, but not in HTTP/2: an HTTP/1 port, such as a")
            .append(" metrics one?");
      } else if (over.equals("plaintext") && said.contains("Network closed for unknown reason")) {
        // A TLS server closes a plaintext connection before HTTP/2 starts.
        line.append("; closed before HTTP/2 began, as a TLS gateway does: set ")
            .append(CA_ENV)
            .append(" to its CA file");
      }
      line.append(')');
    }
    return line.toString().replace('\n', ' ');
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

    GRPC_LOG.setLevel(Level.OFF);
    String problem = addressProblem(addr);
    if (problem != null) {
      usageError("address \"" + addr + "\": " + problem);
    }
    String ca = System.getenv().getOrDefault(CA_ENV, "");
    ManagedChannel channel = channel(addr, credentials(ca));
    String over = ca.isEmpty() ? "plaintext" : "TLS with " + CA_ENV + "=" + ca;
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
      System.err.println(describe(e, addr, over));
      exit = 1;
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
    System.exit(exit);
  }
}
