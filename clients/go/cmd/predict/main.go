// Command predict calls hopline's gateway once, with a deadline, and prints the answer and
// the trace id to look the request up in Jaeger. With HOPLINE_API_KEY set it sends that key
// (a gateway with HOPLINE_API_KEYS needs one; the key names the tenant).
//
//	go run ./cmd/predict -addr 127.0.0.1:8001 -text "where is my order"
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	commonv1 "hopline.dev/clients/go/gen/hopline/common/v1"
	gatewayv1 "hopline.dev/clients/go/gen/hopline/gateway/v1"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8001", "the gateway's address")
	text := flag.String("text", "where is my order", "text to classify")
	tenant := flag.String("tenant", "", "tenant, when the call carries no API key")
	timeout := flag.Duration("timeout", 5*time.Second, "deadline for the whole request")
	flag.Parse()

	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "cannot reach %s: %v\n", *addr, err)
		os.Exit(2)
	}
	defer conn.Close()

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if key := os.Getenv("HOPLINE_API_KEY"); key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)
	}
	reply, err := gatewayv1.NewGatewayServiceClient(conn).Predict(ctx, &gatewayv1.PredictRequest{
		Text:   *text,
		Tenant: *tenant,
	})
	if err != nil {
		st := status.Convert(err)
		fmt.Fprintf(os.Stderr, "predict failed: %s: %s\n", st.Code(), st.Message())
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
