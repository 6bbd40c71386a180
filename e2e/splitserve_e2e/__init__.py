"""A real local Kubernetes control plane for tests and `make demo`.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from Go modules run as
local processes on loopback; kwok provides fake GPU nodes; a real kubelet node (kubelet,
containerd, runc, a CNI bridge, kube-proxy) runs the pods that must really serve as containers
from the project's image; Prometheus (also built from its Go module, since Debian's lacks
Kubernetes discovery) scrapes them.
"""
