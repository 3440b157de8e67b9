// Command predict calls hopline's gateway once, with a deadline, and prints the answer and
// the trace id to look the request up in Jaeger. With HOPLINE_API_KEY set it sends that key
// (a gateway with HOPLINE_API_KEYS needs one; the key names the tenant). With HOPLINE_TLS_CA
// set (a PEM CA file) it dials over TLS and verifies the gateway's certificate against that
// CA; unset, plaintext.
//
//	go run ./cmd/predict -addr 127.0.0.1:8001 -text "where is my order"
//
// Exit status: 0 answered, 1 the call failed (its gRPC status on stderr, as
// INVALID_ARGUMENT, UNAVAILABLE...), 2 a usage mistake (one line on stderr, nothing sent).
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	commonv1 "hopline.dev/clients/go/gen/hopline/common/v1"
	gatewayv1 "hopline.dev/clients/go/gen/hopline/gateway/v1"
)

const keyRule = "an API key must be printable ASCII with no spaces around it " +
	"(it is sent as 'authorization: Bearer <key>')"

// caEnv names the CA file that turns TLS on, as for `hopline predict`.
const caEnv = "HOPLINE_TLS_CA"

var (
	// An IPv4 address or a DNS name: labels of letters, digits and inner hyphens.
	hostName = regexp.MustCompile(
		`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$`)
	ipv6 = regexp.MustCompile(`^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?$`)
	port = regexp.MustCompile(`^[0-9]{1,5}$`)
)

// addressProblem says what is wrong with addr, or "" for a host:port the example dials: a
// name or an IPv4 address, or an IPv6 address in brackets, then a port from 1 to 65535.
// The same rule as the Java and Node examples; grpc-go would take some of these as a target
// to resolve and fail each call instead (UNKNOWN "failed to exit idle mode", UNAVAILABLE
// "invalid port").
func addressProblem(addr string) string {
	const give = "give host:port, as 127.0.0.1:8001"
	if addr == "" {
		return "empty: " + give
	}
	if strings.Contains(addr, "://") {
		return "a URL, not an address: " + give
	}
	var host, portText string
	if strings.HasPrefix(addr, "[") {
		end := strings.Index(addr, "]")
		if end < 0 {
			return "no ']' closes the IPv6 address: give [address]:port, as [::1]:8001"
		}
		host, portText = addr[1:end], addr[end+1:]
		if !strings.HasPrefix(portText, ":") {
			return "no :port after the ']': give [address]:port, as [::1]:8001"
		}
		portText = portText[1:]
		if !ipv6.MatchString(host) {
			return fmt.Sprintf("[%s] is not an IPv6 address", host)
		}
	} else {
		colon := strings.LastIndex(addr, ":")
		if colon < 0 {
			return "no port: " + give
		}
		host, portText = addr[:colon], addr[colon+1:]
		if strings.Contains(host, ":") {
			return "an IPv6 address goes in brackets, as [::1]:8001"
		}
		if host == "" {
			return "no host before the ':': " + give
		}
		if !hostName.MatchString(host) {
			return fmt.Sprintf("host %q is not a name or an IP address", host)
		}
	}
	if portText == "" {
		return "no port after the ':': " + give
	}
	if n, err := strconv.Atoi(portText); err != nil || !port.MatchString(portText) ||
		n < 1 || n > 65535 {
		return fmt.Sprintf("port %q is not a number from 1 to 65535", portText)
	}
	return ""
}

// transport: plaintext, or TLS verifying the gateway against the CA in HOPLINE_TLS_CA; and
// how it is said in a failure.
func transport() (credentials.TransportCredentials, string) {
	ca := os.Getenv(caEnv)
	if ca == "" {
		return insecure.NewCredentials(), "plaintext"
	}
	pem, err := os.ReadFile(ca)
	var pathErr *fs.PathError
	if errors.As(err, &pathErr) {
		usageError("%s=%q: cannot read it: %v", caEnv, ca, pathErr.Err)
	} else if err != nil {
		usageError("%s=%q: cannot read it: %v", caEnv, ca, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		usageError("%s=%q holds no PEM certificate", caEnv, ca)
	}
	// The gateway's certificate must name the host dialled (make certs's name 127.0.0.1
	// and localhost beside gateway).
	return credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}),
		fmt.Sprintf("TLS with %s=%s", caEnv, ca)
}

// usageError says what is wrong with how the command was called, in one line, and exits 2.
func usageError(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "predict: error: "+format+"\n", a...)
	os.Exit(2)
}

// sendableKey: a key travels in an HTTP/2 header, which carries printable ASCII only.
func sendableKey(key string) bool {
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			return false
		}
	}
	return true
}

func main() {
	flags := flag.NewFlagSet("predict", flag.ContinueOnError)
	flags.SetOutput(io.Discard) // errors are said by usageError, in one line
	addr := flags.String("addr", "127.0.0.1:8001", "the gateway's address")
	text := flags.String("text", "where is my order", "text to classify")
	tenant := flags.String("tenant", "", "tenant, when the call carries no API key")
	timeout := flags.Duration("timeout", 5*time.Second, "deadline for the whole request")
	if err := flags.Parse(os.Args[1:]); errors.Is(err, flag.ErrHelp) {
		fmt.Println("usage: predict [-addr host:port] [-text text] [-tenant name] [-timeout 5s]")
		flags.SetOutput(os.Stdout)
		flags.PrintDefaults()
		return
	} else if err != nil {
		usageError("%v", err)
	}
	if flags.NArg() > 0 {
		usageError("unexpected argument %q (the text goes in -text)", flags.Arg(0))
	}
	if *timeout <= 0 {
		usageError("-timeout must be above 0, got %v", *timeout)
	}
	// Refused here, not by grpc-go as an INTERNAL "error while marshaling".
	for _, given := range []struct{ flag, value string }{{"-text", *text}, {"-tenant", *tenant}} {
		if !utf8.ValidString(given.value) {
			usageError("%s is not UTF-8 text (the gateway takes UTF-8): convert it, as with iconv", given.flag)
		}
	}
	// Refused here, not by grpc-go as an INTERNAL "non-printable ASCII characters". Only
	// ASCII white space is trimmed, as the other clients do: a key ending in a no-break space
	// is not printable ASCII.
	key := strings.Trim(os.Getenv("HOPLINE_API_KEY"), " \t\r\n")
	if !sendableKey(key) {
		usageError("HOPLINE_API_KEY: %s", keyRule)
	}

	// Checked here: grpc.NewClient accepts most of what does not parse as host:port, and
	// every call on it then fails (UNKNOWN "failed to exit idle mode", UNAVAILABLE).
	if problem := addressProblem(*addr); problem != "" {
		usageError("address %q: %s", *addr, problem)
	}
	creds, over := transport()

	// NewClient connects lazily; a gateway that does not answer fails the call below. It
	// reads the address as a URL's: an IPv6 zone's '%' is written %25 there.
	conn, err := grpc.NewClient(strings.ReplaceAll(*addr, "%", "%25"),
		grpc.WithTransportCredentials(creds))
	if err != nil {
		usageError("address %q: %v", *addr, err)
	}
	defer conn.Close()

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)
	}
	var trailer metadata.MD
	reply, err := gatewayv1.NewGatewayServiceClient(conn).Predict(ctx, &gatewayv1.PredictRequest{
		Text:   *text,
		Tenant: *tenant,
	}, grpc.Trailer(&trailer))
	if err != nil {
		st := status.Convert(err)
		// The canonical name (INVALID_ARGUMENT), as the other clients print it; Go's own
		// Code.String() is InvalidArgument.
		line := fmt.Sprintf("predict failed: %s: %s", code.Code(st.Code()), st.Message())
		// No trailers: no gateway answered (its own errors carry x-hopline-trace-id), and
		// grpc-go's message ("produced zero addresses", "context deadline exceeded while
		// waiting for connections to become ready") does not say where it looked.
		if len(trailer) == 0 && (st.Code() == codes.Unavailable || st.Code() == codes.DeadlineExceeded) {
			line += fmt.Sprintf(" (gateway address %s over %s", *addr, over)
			// An HTTP/1 server answers with a status line, read as a frame far too large; a
			// TLS server closes a plaintext connection before HTTP/2 starts.
			if strings.Contains(st.Message(), "frame too large") {
				line += "; the server there answered, but not in HTTP/2: an HTTP/1 port, " +
					"such as a metrics one?"
			} else if over == "plaintext" && strings.Contains(st.Message(), "server preface") {
				line += "; closed before HTTP/2 began, as a TLS gateway does: set " + caEnv +
					" to its CA file"
			}
			line += ")"
		}
		fmt.Fprintln(os.Stderr, strings.ReplaceAll(line, "\n", " "))
		conn.Close()
		os.Exit(1)
	}
	outcome, known := commonv1.CacheOutcome_name[int32(reply.GetCache().GetOutcome())]
	if !known {
		outcome = "UNRECOGNIZED" // a newer gateway's outcome, as Java and Node print it
	}
	fmt.Printf("label=%s score=%.4f model=%s/%s cache=%s trace_id=%s\n",
		reply.GetPrediction().GetLabel(),
		reply.GetPrediction().GetScore(),
		reply.GetModel(),
		reply.GetModelVersion(),
		outcome,
		reply.GetTraceId(),
	)
}
