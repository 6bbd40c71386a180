"""How fast the operator turns an InferenceService into its children, and what it costs.

A real local control plane (etcd, kube-apiserver, controller manager, scheduler, kwok GPU
nodes; :class:`splitserve_e2e.cluster.LocalCluster`) and the real operator process
(``splitserve operator``, namespace-scoped, no leader election) run side by side.

Figures, measured in one run:

* **reconcile latency**: from the create of an InferenceService (one API call) until all
  of its children exist (ConfigMap, 3 Deployments, 3 Services, 3 PDBs, 4 NetworkPolicies),
  median and p99 over ``--runs`` objects created one at a time; the children are counted with
  metadata-only lists every 10 ms, so the poll costs the machine little and adds little;
* **baseline**: ``kubectl apply --server-side`` of the same rendered children (what a human
  or a GitOps tool would do without an operator), median and p99 over the same number of
  runs, taken in turn with the operator's (one of each, ``--gap-seconds`` apart, so both see
  the same load); the printed ratio is operator / kubectl;
* both **at the start** (1 to ``--runs`` InferenceServices exist) and **at scale** (once
  ``--services`` exist and have been reconciled, the timed ones come on top);
* **API requests**: the operator's own requests (its
  ``splitserve_operator_api_requests_total{verb,resource}``) from the first create until the
  operator is quiet again, per created InferenceService and per reconcile (the operator's
  ``splitserve_operator_reconcile_seconds_count``); kopf's own PATCHes of the InferenceServices
  (its progress annotations) are read from the API server's ``apiserver_request_total``
  (nothing else patches them here);
* **memory**: the operator's RSS at idle, when ``--services`` InferenceServices on ``--nodes``
  kwok nodes (default: enough for every pool pod) have all been reconciled once
  (status.observedGeneration set), and once it is quiet after that.

The autoscaler is disabled with a 1 h interval in every object: its rounds (one status read
per object per interval even when disabled) are not the reconciler's cost.

    python bench/operator_reconcile.py [--runs 20] [--services 200] [--nodes N]

Writes ``$OUT/operator_reconcile.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families

import splitserve_contract as contract
from splitserve_e2e.cluster import ClusterOptions, LocalCluster
from splitserve_e2e.kwok import (
    KWOK_NODE_LABEL,
    KWOK_NODE_LABEL_VALUE,
    KWOK_TAINT_KEY,
    GpuNodeShape,
    kwok_toleration,
)
from splitserve_e2e.net import free_port
from splitserve_operator.api import InferenceService
from splitserve_operator.render import render_children

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "helm" / "splitserve" / "crds"
NAMESPACE = "bench"
CHILDREN_PER_SERVICE = 14
GPUS_PER_SERVICE = 2
GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
CHILD_COLLECTIONS = (
    f"/api/v1/namespaces/{NAMESPACE}/configmaps",
    f"/api/v1/namespaces/{NAMESPACE}/services",
    f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
    f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets",
    f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies",
)
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def manifest(name: str) -> dict[str, Any]:
    kwok = {"tolerations": [kwok_toleration()], "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": "hf://bench/model"},
            "prefill": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 1}, **kwok},
            "decode": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 1}, **kwok},
            # The autoscaler's rounds (a status read per service per interval even when disabled)
            # are kept out of the reconciler's figures.
            "autoscaling": {"enabled": False, "interval": "1h"},
        },
    }


def _raw_get(api: k8s.ApiClient, path: str, *, query: list[tuple[str, str]], accept: str) -> bytes:
    method, url, headers, _body, _post = api.param_serialize(
        method="GET",
        resource_path=path,
        query_params=query,
        header_params={"Accept": accept},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(method, url, header_params=headers, _request_timeout=10)
    data: bytes = response.read()
    if response.status != 200:
        raise RuntimeError(f"GET {path}: {response.status}")
    return data


def count_children(api: k8s.ApiClient, name: str) -> int:
    """Children of ``name`` that exist, from metadata-only lists (cheap to send and to read)."""
    query = [("labelSelector", f"{contract.LABEL_INSTANCE}={name}")]
    return sum(
        len(json.loads(_raw_get(api, path, query=query, accept=METADATA_ONLY)).get("items") or [])
        for path in CHILD_COLLECTIONS
    )


def time_operator(api: k8s.ApiClient, name: str, *, timeout_seconds: float = 900.0) -> float:
    custom = k8s.CustomObjectsApi(api)
    started = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest(name))
    while count_children(api, name) < CHILDREN_PER_SERVICE:
        if time.monotonic() - started > timeout_seconds:
            raise TimeoutError(f"children of {name} not created within {timeout_seconds}s")
        time.sleep(0.01)
    return time.monotonic() - started


def time_kubectl(cluster: LocalCluster, name: str) -> float:
    isvc = InferenceService.parse(
        {**manifest(name), "metadata": {"name": name, "namespace": NAMESPACE, "uid": "bench", "generation": 1}}
    )
    children = render_children(isvc=isvc, runtime_image="img:1", router_service_account="", include_replicas=True)
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": children})
    started = time.monotonic()
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=body)
    return time.monotonic() - started


def operator_counters(port: int) -> dict[str, float]:
    """The operator's request counts by "verb resource", and ``reconciles``."""
    for attempt in range(5):  # a busy operator (1,000 services starting) may answer slowly
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            break
        except OSError:
            if attempt == 4:
                raise
            time.sleep(5.0)
    out: dict[str, float] = {"reconciles": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{contract.OperatorMetric.API_REQUESTS_TOTAL}":
                key = f"{sample.labels['verb']} {sample.labels['resource']}"
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == f"{contract.OperatorMetric.RECONCILE_SECONDS}_count":
                out["reconciles"] += sample.value
    return out


def kopf_patches(api: k8s.ApiClient) -> float:
    """PATCHes of InferenceServices themselves (not /status) the API server has served."""
    text = _raw_get(api, "/metrics", query=[], accept="text/plain").decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "apiserver_request_total"
                and labels.get("resource") == PLURAL
                and labels.get("verb") == "PATCH"
                and not labels.get("subresource")
            ):
                total += sample.value
    return total


def settle(port: int, *, quiet_seconds: float = 6.0, timeout_seconds: float = 180.0) -> None:
    """Wait until the operator has run no reconcile for ``quiet_seconds``."""
    started = changed = time.monotonic()
    last = operator_counters(port)["reconciles"]
    while time.monotonic() - changed < quiet_seconds and time.monotonic() - started < timeout_seconds:
        time.sleep(1.0)
        now = operator_counters(port)["reconciles"]
        if now != last:
            last, changed = now, time.monotonic()


def requests_of(before: dict[str, float], after: dict[str, float], *, services: int) -> dict[str, Any]:
    """Requests between two scrapes: by "verb resource", per created service, per reconcile."""
    by_call = {k: after[k] - before.get(k, 0.0) for k in after if k != "reconciles" and after[k] > before.get(k, 0.0)}
    total = sum(by_call.values())
    reconciles = after["reconciles"] - before["reconciles"]
    return {
        "total": total,
        "reconciles": reconciles,
        "per_service": round(total / services, 1),
        "reconciles_per_service": round(reconciles / services, 2),
        "per_reconcile": round(total / reconciles, 1) if reconciles else None,
        "by_call_per_service": {k: round(v / services, 2) for k, v in sorted(by_call.items(), key=lambda kv: -kv[1])},
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def compare(
    op: Callable[[int], float], kubectl: Callable[[int], float], *, runs: int, gap_seconds: float
) -> dict[str, Any]:
    """``runs`` of each, in turn, ``gap_seconds`` apart; medians, p99s and their ratios."""
    op_times: list[float] = []
    kubectl_times: list[float] = []
    for i in range(runs):
        op_times.append(op(i))
        time.sleep(gap_seconds)
        kubectl_times.append(kubectl(i))
        time.sleep(gap_seconds)
    result: dict[str, Any] = {
        "operator_median_s": round(statistics.median(op_times), 3),
        "operator_p99_s": round(percentile(op_times, 0.99), 3),
        "kubectl_median_s": round(statistics.median(kubectl_times), 3),
        "kubectl_p99_s": round(percentile(kubectl_times, 0.99), 3),
    }
    result["ratio_median"] = round(result["operator_median_s"] / result["kubectl_median_s"], 2)
    result["ratio_p99"] = round(result["operator_p99_s"] / result["kubectl_p99_s"], 2)
    result["operator_s"] = [round(t, 3) for t in op_times]
    result["kubectl_s"] = [round(t, 3) for t in kubectl_times]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--services", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=0, help="kwok GPU nodes (default: enough for all pools)")
    parser.add_argument(
        "--gap-seconds",
        type=float,
        default=2.0,
        help="pause after each timed create, so the next one starts on a quiet machine",
    )
    args = parser.parse_args()
    if args.services < args.runs + 2:
        parser.error("--services must be at least --runs + 2 (the first timed objects count)")
    gpus_per_node = GpuNodeShape().gpus_per_node
    nodes = args.nodes or math.ceil(args.services * GPUS_PER_SERVICE / gpus_per_node) + 1

    state = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    options = ClusterOptions(num_gpu_nodes=nodes, with_prometheus=False, with_kubelet_node=False)
    result: dict[str, Any] = {"runs": args.runs, "services": args.services, "nodes": nodes}
    with LocalCluster(state_dir=state, options=options) as cluster:
        api = cluster.api_client()
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))

        def established() -> bool:
            got = cluster.kubectl("get", "crd", "inferenceservices.splitserve.dev", "-o", "json", check=False)
            conditions = (
                (json.loads(got.stdout).get("status") or {}).get("conditions") or [] if got.returncode == 0 else []
            )
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        cluster.wait_for(established, timeout_seconds=60, what="CRD Established")
        cluster.kubectl("create", "namespace", NAMESPACE)
        # The router has no placement fields: without the kwok taint its pods run on the kwok
        # nodes too, and every service becomes Ready (no pods pending for ever, no progress
        # deadline passing in the middle of the figures).
        cluster.kubectl("taint", "nodes", "-l", f"{KWOK_NODE_LABEL}={KWOK_NODE_LABEL_VALUE}", f"{KWOK_TAINT_KEY}-")
        env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), POD_IP="127.0.0.1")
        log = (state / "operator.log").open("w")
        port = free_port()
        operator = subprocess.Popen(
            [
                "splitserve",
                "operator",
                "--namespace",
                NAMESPACE,
                "--no-leader-election",
                "--metrics-port",
                str(port),
                "--health-port",
                str(free_port()),
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        custom = k8s.CustomObjectsApi(api)
        try:
            time.sleep(3.0)  # import + initial listing
            result["rss_idle_mib"] = round(rss_mib(operator.pid), 1)
            time_operator(api, "warmup")  # first reconcile pays for lazy imports and connections
            time_kubectl(cluster, "warmup-kubectl")
            settle(port)

            before, patches = operator_counters(port), kopf_patches(api)
            result["at_start"] = compare(
                lambda i: time_operator(api, f"op-{i}"),
                lambda i: time_kubectl(cluster, f"kc-{i}"),
                runs=args.runs,
                gap_seconds=args.gap_seconds,
            )
            settle(port)
            result["requests_at_start"] = requests_of(before, operator_counters(port), services=args.runs)
            result["requests_at_start"]["kopf_patches_per_service"] = round(
                (kopf_patches(api) - patches) / args.runs, 2
            )
            print(json.dumps(result), flush=True)

            existing = args.runs + 1
            names = [f"scale-{i}" for i in range(args.services - existing)]
            started = time.monotonic()
            for name in names:
                custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest(name))

            def all_reconciled() -> bool:
                listing: Any = custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
                items: list[dict[str, Any]] = listing["items"]
                done = [i for i in items if (i.get("status") or {}).get("observedGeneration")]
                return bool(len(done) >= existing + len(names))

            cluster.wait_for(
                all_reconciled,
                timeout_seconds=3600,
                interval_seconds=2.0,
                what=f"{existing + len(names)} InferenceServices reconciled",
            )
            result["reconcile_all_s"] = round(time.monotonic() - started, 1)
            result["rss_all_reconciled_mib"] = round(rss_mib(operator.pid), 1)
            print(json.dumps(result), flush=True)
            settle(port, timeout_seconds=600)
            result["rss_at_scale_mib"] = round(rss_mib(operator.pid), 1)

            before = operator_counters(port)
            result["at_scale"] = compare(
                lambda i: time_operator(api, f"op-n-{i}"),
                lambda i: time_kubectl(cluster, f"kc-n-{i}"),
                runs=args.runs,
                gap_seconds=args.gap_seconds,
            )
            settle(port)
            result["requests_at_scale"] = requests_of(before, operator_counters(port), services=args.runs)
            result["rss_after_mib"] = round(rss_mib(operator.pid), 1)
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
