// Command pause is the sandbox ("pause") container of the e2e kubelet node: there is no
// registry.k8s.io here, so the pause image is built from this file. Like Kubernetes' own
// pause (build/pause/linux/pause.c) it sleeps until SIGINT/SIGTERM and, as PID 1 of the pod's
// PID namespace when that is shared, reaps orphaned children.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if os.Getpid() != 1 {
		os.Stderr.WriteString("warning: pause should be the first process\n")
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Stderr.WriteString("shutting down, got signal\n")
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
