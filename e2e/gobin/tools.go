//go:build tools

// Package gobin only exists to pin the control-plane commands in go.mod so that
// `go build k8s.io/kubernetes/cmd/...` resolves against one reproducible graph.
package gobin

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
