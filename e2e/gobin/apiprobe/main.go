// Command apiprobe checks, from inside a pod, that the API server is reachable the way
// in-cluster clients reach it: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT,
// the server certificate verified against the mounted cluster CA, authenticated with the
// mounted ServiceAccount token. It POSTs a SelfSubjectReview and prints the JSON answer on one
// line (the user the API server sees). Busybox's wget cannot do this: its TLS has no cipher
// suite in common with the API server.
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

const mounted = "/var/run/secrets/kubernetes.io/serviceaccount/"

func main() {
	if err := probe(); err != nil {
		fmt.Fprintln(os.Stderr, "apiprobe:", err)
		os.Exit(1)
	}
}

func probe() error {
	token, err := os.ReadFile(mounted + "token")
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(mounted + "ca.crt")
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %sca.crt", mounted)
	}
	host := net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}
	body := `{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`
	request, err := http.NewRequest(http.MethodPost,
		"https://"+host+"/apis/authentication.k8s.io/v1/selfsubjectreviews", bytes.NewBufferString(body))
	if err != nil {
		return err
	}
	request.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	request.Header.Set("Content-Type", "application/json")
	response, err := client.Do(request)
	if err != nil {
		return err
	}
	defer response.Body.Close()
	answer, err := io.ReadAll(response.Body)
	if err != nil {
		return err
	}
	if response.StatusCode != http.StatusCreated {
		return fmt.Errorf("%s: %s", response.Status, answer)
	}
	fmt.Println(strings.TrimSpace(string(answer)))
	return nil
}
