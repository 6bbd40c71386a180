"""kube-controller-manager and kube-scheduler.

Only the controllers the project's workloads exercise run (Deployments, ReplicaSets, garbage
collection of owned objects, EndpointSlices, namespaces, ServiceAccounts and their tokens, the
root CA ConfigMap, PodDisruptionBudgets, pod GC, ClusterRole aggregation, node lifecycle
taints, PersistentVolume binding for ``pvc://`` models): every extra
controller costs informers and CPU on a two-core machine. Both components run without leader
election and without their HTTPS endpoints (``--secure-port=0``); their health shows through
the API (the ``default`` ServiceAccount appears, pods get bound).
"""

from __future__ import annotations

from pathlib import Path

from splitserve_e2e.pki import ClusterPki
from splitserve_e2e.process import ManagedProcess, start_process

CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",  # LeaderWorkerSet groups are StatefulSets
    "garbage-collector-controller",
    "endpointslice-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "disruption-controller",
    "pod-garbage-collector-controller",
    "clusterrole-aggregation-controller",
    # removes the node.kubernetes.io/not-ready taint that admission puts on every new Node once
    # the node reports Ready (and taints nodes whose Lease goes stale), as in a real cluster
    "node-lifecycle-controller",
    # binds PersistentVolumeClaims to PersistentVolumes (pvc:// models; e2e/test_model_pvc.py)
    "persistentvolume-binder-controller",
)


def start_controller_manager(
    *, binary: Path, kubeconfig: Path, pki: ClusterPki, log_dir: Path, pid_dir: Path
) -> ManagedProcess:
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--controllers={','.join(CONTROLLERS)}",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca_cert}",
        "--use-service-account-credentials=true",  # each controller acts as its own SA (RBAC)
        "--leader-elect=false",
        "--secure-port=0",
        "--profiling=false",
        "--concurrent-gc-syncs=5",
        "--v=1",
    ]
    return start_process(
        name="kube-controller-manager", argv=argv, log_path=log_dir / "kube-controller-manager.log", pid_dir=pid_dir
    )


def start_scheduler(*, binary: Path, kubeconfig: Path, log_dir: Path, pid_dir: Path) -> ManagedProcess:
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--secure-port=0",
        "--profiling=false",
        "--v=1",
    ]
    return start_process(name="kube-scheduler", argv=argv, log_path=log_dir / "kube-scheduler.log", pid_dir=pid_dir)
