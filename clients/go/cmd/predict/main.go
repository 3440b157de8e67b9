// Command predict calls hopline's gateway once, with a deadline, and prints the answer and
// the trace id to look the request up in Jaeger. With HOPLINE_API_KEY set it sends that key
// (a gateway with HOPLINE_API_KEYS needs one; the key names the tenant).
//
//	go run ./cmd/predict -addr 127.0.0.1:8001 -text "where is my order"
//
// Exit status: 0 answered, 1 the call failed (its gRPC status on stderr, as
// INVALID_ARGUMENT, UNAVAILABLE...), 2 a usage mistake (one line on stderr, nothing sent).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	commonv1 "hopline.dev/clients/go/gen/hopline/common/v1"
	gatewayv1 "hopline.dev/clients/go/gen/hopline/gateway/v1"
)

const keyRule = "an API key must be printable ASCII with no spaces around it " +
	"(it is sent as 'authorization: Bearer <key>')"

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
	// Refused here, not by grpc-go as an INTERNAL "non-printable ASCII characters".
	key := strings.TrimSpace(os.Getenv("HOPLINE_API_KEY"))
	if !sendableKey(key) {
		usageError("HOPLINE_API_KEY: %s", keyRule)
	}

	// NewClient connects lazily: it fails only for an address it cannot parse; a gateway
	// that does not answer fails the call below with UNAVAILABLE.
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		usageError("-addr %q: %v", *addr, err)
	}
	defer conn.Close()

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)
	}
	reply, err := gatewayv1.NewGatewayServiceClient(conn).Predict(ctx, &gatewayv1.PredictRequest{
		Text:   *text,
		Tenant: *tenant,
	})
	if err != nil {
		st := status.Convert(err)
		// The canonical name (INVALID_ARGUMENT), as the other clients print it; Go's own
		// Code.String() is InvalidArgument.
		fmt.Fprintf(os.Stderr, "predict failed: %s: %s\n", code.Code(st.Code()), st.Message())
		conn.Close()
		os.Exit(1)
	}
	fmt.Printf("label=%s score=%.4f model=%s/%s cache=%s trace_id=%s\n",
		reply.GetPrediction().GetLabel(),
		reply.GetPrediction().GetScore(),
		reply.GetModel(),
		reply.GetModelVersion(),
		commonv1.CacheOutcome_name[int32(reply.GetCache().GetOutcome())],
		reply.GetTraceId(),
	)
}
