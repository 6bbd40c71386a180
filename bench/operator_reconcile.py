"""How fast the operator turns an InferenceService into its children, and what it costs.

A real local control plane (etcd, kube-apiserver, controller manager, scheduler, kwok GPU
nodes; :class:`splitserve_e2e.cluster.LocalCluster`) and the real operator process
(``splitserve operator``, namespace-scoped, no leader election) run side by side.

Figures, measured in one run:

* **reconcile latency**: from the create of an InferenceService (one API call) until all
  of its children exist (ConfigMap, 3 Deployments, 3 Services, 3 PDBs, 4 NetworkPolicies),
  median and p99 over ``--runs`` objects created one at a time;
* **baseline**: ``kubectl apply --server-side`` of the same rendered children (what a human
  or a GitOps tool would do without an operator), median and p99 over the same number of
  runs; the printed ratio is operator / kubectl;
* **memory**: the operator's RSS at idle and after ``--services`` InferenceServices on
  ``--nodes`` kwok nodes have all been reconciled once (status.observedGeneration set).

    python bench/operator_reconcile.py [--runs 20] [--services 200] [--nodes 200]

Writes ``$OUT/operator_reconcile.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

import splitserve_contract as contract
from splitserve_e2e.cluster import ClusterOptions, LocalCluster
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_e2e.net import free_port
from splitserve_operator.api import InferenceService
from splitserve_operator.render import render_children

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "helm" / "splitserve" / "crds"
NAMESPACE = "bench"
CHILDREN_PER_SERVICE = 14
GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL


def manifest(name: str) -> dict[str, Any]:
    kwok = {"tolerations": [kwok_toleration()], "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": contract.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "hf://bench/model"},
            "prefill": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 1}, **kwok},
            "decode": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 1}, **kwok},
            "autoscaling": {"enabled": False},
        },
    }


def count_children(api: k8s.ApiClient, name: str) -> int:
    selector = f"{contract.LABEL_INSTANCE}={name}"
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    policy, net = k8s.PolicyV1Api(api), k8s.NetworkingV1Api(api)
    return sum(len(items) for items in (
        core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items,
        core.list_namespaced_service(NAMESPACE, label_selector=selector).items,
        apps.list_namespaced_deployment(NAMESPACE, label_selector=selector).items,
        policy.list_namespaced_pod_disruption_budget(NAMESPACE, label_selector=selector).items,
        net.list_namespaced_network_policy(NAMESPACE, label_selector=selector).items,
    ))


def time_operator(api: k8s.ApiClient, name: str, *, timeout_seconds: float = 60.0) -> float:
    custom = k8s.CustomObjectsApi(api)
    started = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest(name))
    while count_children(api, name) < CHILDREN_PER_SERVICE:
        if time.monotonic() - started > timeout_seconds:
            raise TimeoutError(f"children of {name} not created within {timeout_seconds}s")
        time.sleep(0.02)
    return time.monotonic() - started


def time_kubectl(cluster: LocalCluster, name: str) -> float:
    isvc = InferenceService.parse({**manifest(name), "metadata": {"name": name, "namespace": NAMESPACE,
                                                                  "uid": "bench", "generation": 1}})
    children = render_children(isvc=isvc, runtime_image="img:1", router_service_account="", include_replicas=True)
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": children})
    started = time.monotonic()
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=body)
    return time.monotonic() - started


def mean_reconcile_seconds(port: int) -> float:
    """Mean of the operator's own reconcile histogram (all reconciles so far, incl. re-runs)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{contract.OperatorMetric.RECONCILE_SECONDS}_sum"):
            total += float(line.split()[-1])
        elif line.startswith(f"{contract.OperatorMetric.RECONCILE_SECONDS}_count"):
            count += float(line.split()[-1])
    return total / count if count else float("nan")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--services", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=200)
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    options = ClusterOptions(num_gpu_nodes=args.nodes, with_prometheus=False, with_kubelet_node=False)
    result: dict[str, Any] = {"runs": args.runs, "services": args.services, "nodes": args.nodes}
    with LocalCluster(state_dir=state, options=options) as cluster:
        api = cluster.api_client()
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
        def established() -> bool:
            got = cluster.kubectl("get", "crd", "inferenceservices.splitserve.dev", "-o", "json", check=False)
            conditions = json.loads(got.stdout).get("status", {}).get("conditions", []) if got.returncode == 0 else []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
        cluster.wait_for(established, timeout_seconds=60, what="CRD Established")
        cluster.kubectl("create", "namespace", NAMESPACE)
        env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), POD_IP="127.0.0.1")
        log = (state / "operator.log").open("w")
        metrics_port = free_port()
        operator = subprocess.Popen(
            ["splitserve", "operator", "--namespace", NAMESPACE, "--no-leader-election",
             "--metrics-port", str(metrics_port), "--health-port", str(free_port()), "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(3.0)  # import + initial listing
            result["rss_idle_mib"] = round(rss_mib(operator.pid), 1)
            time_operator(api, "warmup")  # first reconcile pays for lazy imports and connections
            time_kubectl(cluster, "warmup-kubectl")
            op_times = [time_operator(api, f"op-{i}") for i in range(args.runs)]
            kubectl_times = [time_kubectl(cluster, f"kc-{i}") for i in range(args.runs)]
            result.update({
                "operator_median_s": round(statistics.median(op_times), 3),
                "operator_p99_s": round(percentile(op_times, 0.99), 3),
                "kubectl_median_s": round(statistics.median(kubectl_times), 3),
                "kubectl_p99_s": round(percentile(kubectl_times, 0.99), 3),
            })
            result["ratio_median"] = round(result["operator_median_s"] / result["kubectl_median_s"], 2)
            result["ratio_p99"] = round(result["operator_p99_s"] / result["kubectl_p99_s"], 2)
            result["reconcile_mean_s_inside_operator"] = round(mean_reconcile_seconds(metrics_port), 3)
            print(json.dumps(result), flush=True)

            custom = k8s.CustomObjectsApi(api)
            started = time.monotonic()
            names = [f"scale-{i}" for i in range(args.services - args.runs - 1)]
            for name in names:
                custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest(name))

            def all_reconciled() -> bool:
                listing: Any = custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
                items: list[dict[str, Any]] = listing["items"]
                done = [i for i in items if (i.get("status") or {}).get("observedGeneration")]
                return len(done) >= args.services
            cluster.wait_for(all_reconciled, timeout_seconds=900, interval_seconds=2.0,
                             what=f"{args.services} InferenceServices reconciled")
            result["reconcile_all_s"] = round(time.monotonic() - started, 1)
            time.sleep(5.0)
            result["rss_after_services_mib"] = round(rss_mib(operator.pid), 1)
        finally:
            operator.terminate()
            operator.wait(timeout=30)
    print(json.dumps(result, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, "operator_reconcile.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
