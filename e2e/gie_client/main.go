// Command gie-client plays the gateway's side of the Gateway API Inference Extension's
// Endpoint Picker protocol once: it opens an Envoy ext_proc v3 stream to an Endpoint Picker
// (EPP), sends the request headers and the JSON body of one OpenAI request as Envoy's
// ext_proc filter does in FULL_DUPLEX_STREAMED mode, and prints, as JSON, the endpoint the
// picker chose: the x-gateway-destination-endpoint header mutation and the same key in the
// envoy.lb dynamic metadata (the two ways the protocol hands it to a proxy).
//
// It exists because no gateway (Envoy, Istio, kgateway) runs on the e2e harness: the e2e
// test asks the picker where a request should go, then sends the request there itself.
// The ext_proc types come from github.com/envoyproxy/go-control-plane at the version the
// inference extension's own go.mod pins, so both sides speak the same published protos.
//
// Exit status: 0 when the picker routed the request (endpoint printed), 3 when it answered
// with an immediate response instead (its HTTP status and body printed, e.g. 503 when no
// pod is a candidate), 2 for bad flags, 1 for any other error (stderr says which).
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

// Keys of the Endpoint Picker protocol (GIE pkg/epp/metadata, docs/proposals/004).
const (
	destinationEndpointKey       = "x-gateway-destination-endpoint"
	destinationEndpointNamespace = "envoy.lb"
	subsetHintNamespace          = "envoy.lb.subset_hint"
	subsetHintKey                = "x-gateway-destination-endpoint-subset"
	exitImmediateResponse        = 3
)

// Result is what the client prints.
type Result struct {
	// Endpoint is the picked "IP:port" (empty when the picker answered immediately).
	Endpoint string `json:"endpoint"`
	// HeaderEndpoint is the x-gateway-destination-endpoint header mutation.
	HeaderEndpoint string `json:"header_endpoint"`
	// MetadataEndpoint is envoy.lb/x-gateway-destination-endpoint of the dynamic metadata.
	MetadataEndpoint string `json:"metadata_endpoint"`
	// SetHeaders are all header mutations of the request-headers response.
	SetHeaders map[string]string `json:"set_headers"`
	// Body is the (possibly mutated) request body the picker streamed back.
	Body string `json:"body"`
	// ImmediateStatus is the HTTP status of an immediate response (0: none).
	ImmediateStatus int `json:"immediate_status"`
	// ImmediateBody is the body of an immediate response.
	ImmediateBody string `json:"immediate_body"`
	// Seconds is the time from opening the stream to the last answer.
	Seconds float64 `json:"seconds"`
}

type headerFlags []string

func (h *headerFlags) String() string     { return strings.Join(*h, ",") }
func (h *headerFlags) Set(v string) error { *h = append(*h, v); return nil }

type options struct {
	addr      string
	plaintext bool
	path      string
	model     string
	prompt    string
	maxTokens int
	body      string
	subset    string
	headers   headerFlags
	timeout   time.Duration
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("gie-client", flag.ContinueOnError)
	fs.StringVar(&o.addr, "addr", "127.0.0.1:9002", "the EPP's ext_proc gRPC address (host:port)")
	fs.BoolVar(&o.plaintext, "plaintext", false, "no TLS (an EPP run with --secure-serving=false); "+
		"by default TLS without verifying the EPP's self-signed certificate, as gateways do")
	fs.StringVar(&o.path, "path", "/v1/completions", "the request's :path")
	fs.StringVar(&o.model, "model", "", "the OpenAI model field (required unless -body is given)")
	fs.StringVar(&o.prompt, "prompt", "Hello", "the completion prompt")
	fs.IntVar(&o.maxTokens, "max-tokens", 8, "the completion's max_tokens")
	fs.StringVar(&o.body, "body", "", "a raw JSON request body instead of -model/-prompt/-max-tokens")
	fs.StringVar(&o.subset, "subset", "", "comma-separated IP:port candidates sent as the "+
		"envoy.lb.subset_hint metadata (empty: all pods of the pool are candidates)")
	fs.Var(&o.headers, "header", "an extra request header name=value (repeatable)")
	fs.DurationVar(&o.timeout, "timeout", 30*time.Second, "deadline of the whole exchange")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.body == "" && o.model == "" {
		return o, errors.New("-model (or -body) is required")
	}
	for _, h := range o.headers {
		if name, _, ok := strings.Cut(h, "="); !ok || name == "" {
			return o, fmt.Errorf("-header %q: want name=value", h)
		}
	}
	return o, nil
}

func requestBody(o options) ([]byte, error) {
	if o.body != "" {
		var probe map[string]any
		if err := json.Unmarshal([]byte(o.body), &probe); err != nil {
			return nil, fmt.Errorf("-body is not a JSON object: %w", err)
		}
		return []byte(o.body), nil
	}
	return json.Marshal(map[string]any{"model": o.model, "prompt": o.prompt, "max_tokens": o.maxTokens})
}

func requestHeaders(o options, bodyLength int) *corev3.HeaderMap {
	pairs := [][2]string{
		{":method", "POST"}, {":path", o.path}, {":scheme", "http"}, {":authority", "inference-gateway"},
		{"content-type", "application/json"}, {"content-length", fmt.Sprint(bodyLength)},
	}
	for _, h := range o.headers {
		name, value, _ := strings.Cut(h, "=")
		pairs = append(pairs, [2]string{strings.ToLower(name), value})
	}
	headers := make([]*corev3.HeaderValue, 0, len(pairs))
	for _, p := range pairs {
		headers = append(headers, &corev3.HeaderValue{Key: p[0], RawValue: []byte(p[1])})
	}
	return &corev3.HeaderMap{Headers: headers}
}

func subsetMetadata(subset string) (*corev3.Metadata, error) {
	if subset == "" {
		return nil, nil
	}
	var endpoints []any
	for _, e := range strings.Split(subset, ",") {
		if e = strings.TrimSpace(e); e != "" {
			endpoints = append(endpoints, e)
		}
	}
	hint, err := structpb.NewStruct(map[string]any{subsetHintKey: endpoints})
	if err != nil {
		return nil, err
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{subsetHintNamespace: hint}}, nil
}

// exchange runs one request through the picker and returns what it answered.
func exchange(ctx context.Context, o options) (*Result, error) {
	body, err := requestBody(o)
	if err != nil {
		return nil, err
	}
	metadata, err := subsetMetadata(o.subset)
	if err != nil {
		return nil, err
	}
	creds := credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // the EPP's self-signed cert
	if o.plaintext {
		creds = insecure.NewCredentials()
	}
	conn, err := grpc.NewClient(o.addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", o.addr, err)
	}
	defer conn.Close()
	started := time.Now()
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return nil, fmt.Errorf("open the ext_proc stream to %s: %w", o.addr, err)
	}
	send := []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: requestHeaders(o, len(body)), EndOfStream: false}}, MetadataContext: metadata},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: body, EndOfStream: true}}, MetadataContext: metadata},
	}
	for _, message := range send {
		if err := stream.Send(message); err != nil {
			return nil, fmt.Errorf("send to %s: %w", o.addr, err)
		}
	}
	result := &Result{SetHeaders: map[string]string{}}
	var streamed []byte
	for done := false; !done; {
		response, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil, errors.New("the picker closed the stream before answering the request body")
		}
		if err != nil {
			return nil, fmt.Errorf("receive from %s: %w", o.addr, err)
		}
		switch r := response.Response.(type) {
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			result.ImmediateStatus = int(r.ImmediateResponse.GetStatus().GetCode())
			result.ImmediateBody = string(r.ImmediateResponse.GetBody())
			done = true
		case *extprocv3.ProcessingResponse_RequestHeaders:
			for _, option := range r.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				value := string(option.GetHeader().GetRawValue())
				if value == "" {
					value = option.GetHeader().GetValue()
				}
				result.SetHeaders[strings.ToLower(option.GetHeader().GetKey())] = value
			}
			result.HeaderEndpoint = result.SetHeaders[destinationEndpointKey]
			if lb, ok := response.GetDynamicMetadata().GetFields()[destinationEndpointNamespace]; ok {
				result.MetadataEndpoint = lb.GetStructValue().GetFields()[destinationEndpointKey].GetStringValue()
			}
		case *extprocv3.ProcessingResponse_RequestBody:
			chunk := r.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			streamed = append(streamed, chunk.GetBody()...)
			done = chunk.GetEndOfStream()
		default:
			return nil, fmt.Errorf("unexpected ext_proc response %T", r)
		}
	}
	_ = stream.CloseSend()
	result.Body = string(streamed)
	result.Seconds = time.Since(started).Seconds()
	if result.ImmediateStatus != 0 {
		return result, nil
	}
	if result.HeaderEndpoint == "" {
		return result, fmt.Errorf("the picker set no %s header", destinationEndpointKey)
	}
	if result.MetadataEndpoint != "" && result.MetadataEndpoint != result.HeaderEndpoint {
		return result, fmt.Errorf("header endpoint %q and %s metadata endpoint %q differ",
			result.HeaderEndpoint, destinationEndpointNamespace, result.MetadataEndpoint)
	}
	result.Endpoint = result.HeaderEndpoint
	return result, nil
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "gie-client:", err)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	result, err := exchange(ctx, o)
	if result != nil {
		out, _ := json.Marshal(result)
		fmt.Println(string(out))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gie-client:", err)
		os.Exit(1)
	}
	if result.ImmediateStatus != 0 {
		os.Exit(exitImmediateResponse)
	}
}
