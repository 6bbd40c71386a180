"""splitserve behind the Gateway API Inference Extension (GIE), on the real node.

A gateway that implements the GIE routes each request to the pod an Endpoint Picker (EPP)
chooses for it; the picker finds the pods through an ``InferencePool`` and scores them on the
model-server gauges it scrapes from them (queue, KV-cache use, the KV-cache layout). Here an
Aggregated InferenceService with two engine pods (the image built from this tree, on the
kubelet node) asks for ``spec.router.mode: InferencePool``: the operator renders the
InferencePool and the picker (ServiceAccount, Role, RoleBinding, Deployment, Service). The
picker is the real one, built from ``sigs.k8s.io/gateway-api-inference-extension@v1.2.0``
(:mod:`splitserve_e2e.gie`); its upstream image cannot be pulled here, so the same binary is
packed into an image in the loopback registry and named in
``spec.router.inferencePool.picker.image``: the rendered Deployment runs as rendered, with its
flags, ServiceAccount and Role. ``e2e/gie_client`` plays the gateway's side of the ext_proc
protocol, one request at a time, against the picker pod's IP. The GIE CRDs are installed
(``kubectl apply --server-side``) before the operator starts.

Checked: the InferenceService is Ready with the picker; the picker scraped both engine pods
(``inference_pool_ready_pods``), and what it read from each (queue, KV use, KV block size and
count; shown by the same picker run on the host at debug level with the rendered flags, as the
picker's ServiceAccount) equals the pod's own ``vllm:`` gauges; a queue built on one pod shows
in the picker's ``inference_pool_per_pod_queue_size`` and pool averages and steers its picks
to the other pod, and reads 0 again when drained; a picked ``IP:port`` is an engine pod's and
serves the request (200, a completion); the gateway's subset hint restricts the pick, and a
hint naming no pool pod is answered 503 by the picker; upstream's InferencePool CEL
validation tests (``test/cel``) pass against this API server.

GIE conformance (``conformance/``) is not run: all of its tests belong to the Gateway profile,
whose setup waits for an accepted GatewayClass and programmed Gateways (a gateway
implementation such as Envoy Gateway, Istio or kgateway), which this harness does not have.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import splitserve_contract as contract
from splitserve_e2e import gie
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, condition, get_isvc
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.realnode import ISVC_NAME, Stack, explained, isvc_for_node, log, real_node_stack
from splitserve_e2e.stack import SERVED_NAME, ModelHub

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

ENGINES = 2
READY_TIMEOUT_SECONDS = 600.0
POOL_API = "inferencepools.inference.networking.k8s.io"
LOAD_REQUESTS = 5
"""Clients that each send one completion after another to the busy engine until the picker has
shown the load: one sequence runs, four wait."""
LOAD_REQUEST_SECONDS = 3.0
"""About how long each load request runs (estimated from a warm-up request)."""
LOAD_MAX_TOKENS = 900  # the example's maxModelLen is 1024
POOL_AVERAGE_TIMEOUT_SECONDS = 60.0
"""The picker flushes its pool averages every 5 s; the load is held until a flush shows it."""
CEL_CASES = 5  # test/cel/inferencepool_test.go of v1.2.0
_SCRAPED = re.compile(
    r"Address:(?P<ip>[\d.]+) Port:\d+ .*?Metrics: \{.*?"
    r"WaitingQueueSize:(?P<queue>\d+) KVCacheUsagePercent:(?P<kv>[\d.e+-]+) "
    r".*?CacheBlockSize:(?P<block>\d+) CacheNumGPUBlocks:(?P<blocks>\d+)"
)


@dataclass
class Pool:
    """The operator's InferencePool, its engine pods and its picker."""

    name: str
    namespace: str
    pods: dict[str, str]
    """engine pod IP -> pod name (the pool's selector)."""
    port: int
    """The pool's target port (the runtime's HTTP port)."""
    picker_args: list[str]
    """The rendered picker container's arguments."""
    picker_account: str
    picker_ip: str
    picker_ports: dict[str, int]
    """The picker container's ports by name (grpc, grpc-health, metrics)."""
    figures: dict[str, str] = field(default_factory=dict)

    def endpoint(self, ip: str) -> str:
        return f"{ip}:{self.port}"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tools() -> gie.GieBinaries:
    """The picker, upstream's CEL tests and the client (built on demand, cached; .ci/deps
    builds them ahead)."""
    started = time.monotonic()
    binaries = gie.ensure_gie_binaries()
    log(f"GIE binaries ready in {time.monotonic() - started:.1f}s; recorded build times {gie.recorded_build_seconds()}")
    return binaries


@pytest.fixture(scope="module")
def picker_image(tools: gie.GieBinaries) -> str:
    started = time.monotonic()
    reference = gie.ensure_epp_image()
    log(f"picker image {reference} ready in {time.monotonic() - started:.1f}s")
    return reference


@pytest.fixture(scope="module")
def gie_crds(cluster: LocalCluster) -> Iterator[list[Path]]:
    """The GIE CRDs applied server-side and Established (before the operator starts, so it
    finds the InferencePool kind); deleted at the end with whatever is left of them."""
    manifests = gie.ensure_gie_crds()
    for manifest in manifests:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifest))
    names = [_crd_name(manifest) for manifest in manifests]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{name}" for name in names))
    yield manifests
    cluster.kubectl("delete", "crd", "--ignore-not-found", "--timeout=60s", *names, check=False, timeout_seconds=90)


def _crd_name(manifest: Path) -> str:
    match = re.search(r"^  name: (\S+)$", manifest.read_text(), re.MULTILINE)
    assert match is not None, f"no metadata.name in {manifest}"
    return match.group(1)


@pytest.fixture(scope="module")
def stack(
    cluster: LocalCluster, image: str, local_hub: LocalHub, model_hub: ModelHub, gie_crds: list[Path]
) -> Iterator[Stack]:
    # inference_pool: the chart's inferencePool.enabled (off by default), which grants the
    # operator what it needs to create the picker's ServiceAccount, Role and RoleBinding
    with real_node_stack(
        cluster=cluster,
        image=image,
        hub=local_hub,
        model_hub=model_hub,
        workloads=[f"inference-gie-{uuid.uuid4().hex[:4]}"],
        inference_pool=True,
    ) as result:
        yield result


@pytest.fixture(scope="module")
def pool(stack: Stack, picker_image: str) -> Pool:
    """The Aggregated InferenceService in mode InferencePool with two engine pods (one sequence
    per engine step, so a few requests make a queue) and the picker image from the loopback
    registry, Ready; its InferencePool, engine pods and picker pod."""
    cluster, namespace = stack.cluster, stack.namespace
    manifest = isvc_for_node(stack, namespace=namespace, mode="Aggregated", cpu="300m")
    spec = manifest["spec"]
    spec["aggregated"]["replicas"] = {"min": ENGINES, "max": ENGINES}
    spec["scheduling"] = {**spec.get("scheduling", {}), "maxNumSeqs": 1}
    spec["router"] = {"mode": "InferencePool", "inferencePool": {"picker": {"image": picker_image}}}
    with explained(cluster, stack.namespaces):
        started = time.monotonic()
        apply_object(cluster=cluster, obj=manifest)

        def ready() -> bool:
            obj = get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME)
            return (condition(obj, "Ready") or {}).get("status") == "True"

        cluster.wait_for(
            ready,
            timeout_seconds=READY_TIMEOUT_SECONDS,
            interval_seconds=2.0,
            what=f"InferenceService {namespace}/{ISVC_NAME} Ready",
        )
        stack.figures["InferenceService (2 engines + picker) apply -> Ready"] = f"{time.monotonic() - started:.1f}s"
        status = get_isvc(cluster=cluster, namespace=namespace, name=ISVC_NAME)["status"]
        # the picker is counted apart: the ROUTER column shows no router where none runs
        assert status["endpointPicker"]["summary"] == "1/1" and "router" not in status, status
        found = _rendered(cluster, namespace, picker_image)
    found.figures = stack.figures
    log(
        f"InferencePool {namespace}/{found.name}: engines {found.pods}; picker "
        f"{found.picker_ip} {found.picker_ports} as {found.picker_account}"
    )
    return found


def _get(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _rendered(cluster: LocalCluster, namespace: str, picker_image: str) -> Pool:
    """The operator's InferencePool (one, named like the InferenceService), the pods its
    selector matches, and the picker Deployment its endpointPickerRef leads to (through the
    Service), whose pod runs ``picker_image``."""
    pools = _get(cluster, POOL_API, "-n", namespace)["items"]
    assert [p["metadata"]["name"] for p in pools] == [ISVC_NAME], pools
    spec = pools[0]["spec"]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    core: Any = cluster.core()
    pods = {
        p.status.pod_ip: p.metadata.name
        for p in core.list_namespaced_pod(namespace, label_selector=selector).items
        if p.status.pod_ip and p.metadata.deletion_timestamp is None
    }
    assert len(pods) == ENGINES, pods
    service = _get(cluster, "service", spec["endpointPickerRef"]["name"], "-n", namespace)
    assert any(port["port"] == spec["endpointPickerRef"]["port"]["number"] for port in service["spec"]["ports"]), (
        service["spec"],
        spec,
    )
    picker_selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    deployments = _get(cluster, "deployment", "-n", namespace, "-l", picker_selector)["items"]
    assert len(deployments) == 1, [d["metadata"]["name"] for d in deployments]
    template = deployments[0]["spec"]["template"]["spec"]
    container = template["containers"][0]
    assert container["image"] == picker_image, container["image"]
    pickers = [
        p
        for p in core.list_namespaced_pod(namespace, label_selector=picker_selector).items
        if p.status.pod_ip and all(s.ready for s in p.status.container_statuses or [])
    ]
    assert len(pickers) == 1, [p.metadata.name for p in pickers]
    return Pool(
        name=ISVC_NAME,
        namespace=namespace,
        pods=pods,
        port=int(spec["targetPorts"][0]["number"]),
        picker_args=[*container.get("command", [])[1:], *container.get("args", [])],
        picker_account=str(template.get("serviceAccountName", "default")),
        picker_ip=pickers[0].status.pod_ip,
        picker_ports={port["name"]: int(port["containerPort"]) for port in container["ports"]},
    )


@pytest.fixture(scope="module")
def picker(pool: Pool, stack: Stack) -> gie.EndpointPicker:
    """The rendered picker's pod (its IP answers from the host), once it has scraped every
    engine pod (``inference_pool_ready_pods`` counts pods with fresh metrics)."""
    running = gie.EndpointPicker(
        grpc_address=f"{pool.picker_ip}:{pool.picker_ports['grpc']}",
        metrics_url=f"http://{pool.picker_ip}:{pool.picker_ports['metrics']}/metrics",
    )
    with explained(stack.cluster, stack.namespaces):
        stack.cluster.wait_for(
            lambda: _gauge(running, "inference_pool_ready_pods", pool.name) == ENGINES,
            timeout_seconds=60,
            interval_seconds=0.5,
            what=f"the picker to report {ENGINES} pods with fresh metrics",
        )
    return running


@pytest.fixture
def debug_picker(pool: Pool, tools: gie.GieBinaries, stack: Stack) -> Iterator[gie.EndpointPicker]:
    """The same picker on the host, with the rendered flags (its ports excepted) at log level
    7, whose debug dump lists what it scraped from each pod; authenticated as the picker's
    ServiceAccount, so the rendered Role is all it has."""
    cluster = stack.cluster
    kubeconfig = cluster.service_account_kubeconfig(namespace=pool.namespace, service_account=pool.picker_account)
    log_path = cluster.log_dir / f"epp-host-{pool.namespace}.log"
    args = gie.without_flags(pool.picker_args, (*gie.PORT_FLAGS, "-v"))
    running = gie.start_epp(binary=tools.epp, kubeconfig=kubeconfig, args=args, log_path=log_path, verbosity=7)
    try:
        yield running
    finally:
        running.stop()
        log(f"host picker stopped; its log: {log_path}")


# --------------------------------------------------------------------------- helpers
def _samples(picker: gie.EndpointPicker, name: str) -> list[tuple[dict[str, str], float]]:
    return picker.metrics().get(name, [])


def _gauge(picker: gie.EndpointPicker, name: str, pool_name: str) -> float | None:
    values = [v for labels, v in _samples(picker, name) if labels.get("name") == pool_name]
    return values[0] if values else None


def _per_pod_queue(picker: gie.EndpointPicker, pool: Pool) -> dict[str, float]:
    """pod name -> the queue the picker last scraped from it (its per-pod series are named
    ``<pod>-rank-<data-parallel rank>``)."""
    out: dict[str, float] = {}
    for labels, value in _samples(picker, "inference_pool_per_pod_queue_size"):
        if labels.get("name") == pool.name:
            out[labels["model_server_pod"].rsplit("-rank-", 1)[0]] = value
    return out


def _pod_gauges(endpoint: str) -> dict[str, Any]:
    """The pod's own model-server gauges (what the picker should have read)."""
    text = httpx.get(f"http://{endpoint}{contract.METRICS_PATH}", timeout=5.0).text
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                out[sample.name] = sample.labels if sample.name.endswith("_info") else sample.value
    return out


def _scraped(log_path: Path) -> dict[str, dict[str, float]]:
    """pod IP -> the metrics the picker's last debug dump shows for it (queue, KV use, KV block
    size and count)."""
    dumps = [
        line
        for line in log_path.read_text(errors="replace").splitlines()
        if "Current Pods and metrics gathered" in line
    ]
    if not dumps:
        return {}
    return {
        m["ip"]: {
            "queue": float(m["queue"]),
            "kv": float(m["kv"]),
            "block_size": float(m["block"]),
            "num_gpu_blocks": float(m["blocks"]),
        }
        for m in _SCRAPED.finditer(dumps[-1])
    }


def _completion_body(prompt: str, *, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


# --------------------------------------------------------------------------- tests
def test_picker_reads_the_runtime_gauges(
    picker: gie.EndpointPicker, debug_picker: gie.EndpointPicker, pool: Pool
) -> None:
    """Both engine pods are in the picker's pool with fresh metrics, at queue 0; and what the
    picker scraped from each (its debug dump, every 5 s, from the host run with the rendered
    flags) equals the pod's own ``vllm:`` gauges: queue, KV use, KV block size and count."""
    assert _gauge(picker, "inference_pool_ready_pods", pool.name) == ENGINES
    assert _per_pod_queue(picker, pool) == {name: 0 for name in pool.pods.values()}
    assert debug_picker.process is not None
    mismatch: list[str] = ["no debug dump yet"]
    seen: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + 40
    while mismatch and time.monotonic() < deadline:
        time.sleep(1.0)
        seen, mismatch = _scraped(debug_picker.process.log_path), []
        if set(seen) != set(pool.pods):
            mismatch.append(f"dumped pods {sorted(seen)} != engines {sorted(pool.pods)}")
        for ip, values in seen.items():
            own = _pod_gauges(pool.endpoint(ip))
            info = own["vllm:cache_config_info"]
            expected = {
                "queue": own["vllm:num_requests_waiting"],
                "kv": own["vllm:kv_cache_usage_perc"],
                "block_size": float(info["block_size"]),
                "num_gpu_blocks": float(info["num_gpu_blocks"]),
            }
            if values != pytest.approx(expected, abs=1e-9):
                mismatch.append(f"{pool.pods.get(ip, ip)}: picker {values}, pod {expected}")
    assert not mismatch, mismatch
    for ip, values in seen.items():
        log(f"picker read {pool.pods[ip]} ({ip}): {values}")
        assert values["block_size"] > 0 and values["num_gpu_blocks"] > 0, values
    pool.figures["picker's view at idle"] = json.dumps(seen)


def test_queue_on_one_pod_moves_the_pickers_view_and_choice(picker: gie.EndpointPicker, pool: Pool) -> None:
    """Five clients sending completions of about 3 s each, one after another, straight to one
    engine (one sequence per step: one runs, four wait) show in the picker's per-pod queue (read
    at each scrape of the picker) and, held until its next 5 s flush, in its pool averages; they
    steer its picks to the other engine; drained, the queue reads 0 again."""
    (busy_ip, busy), (idle_ip, idle) = sorted(pool.pods.items())
    results: list[int] = []
    started = time.monotonic()
    warm = httpx.post(
        f"http://{pool.endpoint(busy_ip)}/v1/completions",
        timeout=120.0,
        json=_completion_body("warm up", max_tokens=32, ignore_eos=True),
    )
    assert warm.status_code == 200, warm.text
    per_token = (time.monotonic() - started) / 32
    tokens = max(32, min(LOAD_MAX_TOKENS, int(LOAD_REQUEST_SECONDS / per_token)))
    log(f"{busy}: {per_token * 1000:.1f} ms per token; {LOAD_REQUESTS} clients x {tokens} tokens")
    shown = threading.Event()

    def load(index: int) -> None:
        while not shown.is_set():
            body = _completion_body(f"load {index} {uuid.uuid4().hex}", max_tokens=tokens, ignore_eos=True)
            response = httpx.post(f"http://{pool.endpoint(busy_ip)}/v1/completions", json=body, timeout=300.0)
            results.append(response.status_code)

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(LOAD_REQUESTS)]
    for thread in threads:
        thread.start()
    peak: dict[str, float] = {"busy queue": 0.0, "idle queue": 0.0, "pool average queue": 0.0, "pool average kv": 0.0}

    def observe() -> None:
        queues = _per_pod_queue(picker, pool)
        peak["busy queue"] = max(peak["busy queue"], queues.get(busy, 0.0))
        peak["idle queue"] = max(peak["idle queue"], queues.get(idle, 0.0))
        peak["pool average queue"] = max(
            peak["pool average queue"], _gauge(picker, "inference_pool_average_queue_size", pool.name) or 0.0
        )
        peak["pool average kv"] = max(
            peak["pool average kv"], _gauge(picker, "inference_pool_average_kv_cache_utilization", pool.name) or 0.0
        )

    def queued() -> bool:
        observe()
        return peak["busy queue"] >= 2

    def averaged() -> bool:
        observe()
        return peak["pool average queue"] >= 1 and peak["pool average kv"] > 0

    picks: list[gie.Pick] = []
    try:
        LocalCluster.wait_for(
            queued, timeout_seconds=60, interval_seconds=0.1, what=f"the picker to see a queue on {busy}"
        )
        client = gie.ensure_gie_client()
        for index in range(3):
            picks.append(
                gie.pick(
                    client, address=picker.grpc_address, body=_completion_body(f"fresh {index} {uuid.uuid4().hex}")
                )
            )
        with contextlib.suppress(TimeoutError):  # the assertions below say what was missing
            LocalCluster.wait_for(
                averaged,
                timeout_seconds=POOL_AVERAGE_TIMEOUT_SECONDS,
                interval_seconds=0.2,
                what="the picker's pool averages to show the queue",
            )
    finally:
        shown.set()
    while any(thread.is_alive() for thread in threads):
        observe()
        time.sleep(0.2)
    for thread in threads:
        thread.join(timeout=1)
    assert results and results == [200] * len(results), results
    log(f"under load on {busy} ({len(results)} requests): peaks {peak}; picks {[p.endpoint for p in picks]}")
    pool.figures["picker's view under load (peaks)"] = json.dumps(peak)
    assert [p.endpoint for p in picks] == [pool.endpoint(idle_ip)] * 3, (picks, busy, idle)
    assert peak["idle queue"] == 0, peak
    assert peak["pool average queue"] >= 1, peak  # (busy + idle) // 2 (integer division)
    assert peak["pool average kv"] > 0, peak
    LocalCluster.wait_for(
        lambda: _per_pod_queue(picker, pool).get(busy) == 0,
        timeout_seconds=30,
        interval_seconds=0.2,
        what=f"the picker to see {busy}'s queue drained",
    )


def test_picked_endpoint_serves_the_request(picker: gie.EndpointPicker, pool: Pool) -> None:
    """The endpoint the picker returns (header mutation and envoy.lb metadata agree) is an
    engine pod's ``IP:port``, and the request sent there with the body the picker passed on is
    served; the gateway's subset hint restricts the choice, and one naming no pool pod is
    answered 503 by the picker itself."""
    client = gie.ensure_gie_client()
    body = _completion_body("The capital of France is", max_tokens=8)
    chosen = gie.pick(client, address=picker.grpc_address, body=body)
    assert chosen.immediate_status == 0, chosen
    assert chosen.endpoint in {pool.endpoint(ip) for ip in pool.pods}, chosen
    assert chosen.metadata_endpoint == chosen.endpoint, chosen
    assert chosen.body["model"] == SERVED_NAME, chosen
    response = httpx.post(f"http://{chosen.endpoint}/v1/completions", json=chosen.body, timeout=60.0)
    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["model"] == SERVED_NAME and completion["usage"]["completion_tokens"] > 0
    assert isinstance(completion["choices"][0]["text"], str)
    log(
        f"picked {chosen.endpoint} ({pool.pods[chosen.endpoint.split(':')[0]]}) in "
        f"{chosen.seconds * 1000:.0f} ms; served: {completion['choices'][0]['text']!r}"
    )
    pool.figures["picked endpoint"] = chosen.endpoint

    for ip in pool.pods:
        hinted = gie.pick(client, address=picker.grpc_address, body=body, subset=[pool.endpoint(ip)])
        assert hinted.endpoint == pool.endpoint(ip), hinted
    outside = gie.pick(client, address=picker.grpc_address, body=body, subset=["10.213.0.254:8000"])
    assert outside.immediate_status == 503 and outside.endpoint == "", outside
    assert "candidate pods" in outside.immediate_body, outside


def test_upstream_inferencepool_cel_validation(tools: gie.GieBinaries, stack: Stack, gie_crds: list[Path]) -> None:
    """Upstream's InferencePool validation tests (``test/cel`` of the module: CEL rules of the
    v1 CRD) pass against this cluster's API server."""
    cluster = stack.cluster
    try:
        result = subprocess.run(
            [str(tools.cel_test), "-test.v", "-test.count=1"],
            env={"KUBECONFIG": str(cluster.kubeconfig), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.kubectl("delete", POOL_API, "-n", "default", "--all", check=False)
    log(f"upstream CEL tests:\n{result.stdout[-3000:]}{result.stderr[-1000:]}")
    assert result.returncode == 0, result.stdout + result.stderr
    passed = re.findall(r"^    --- PASS: ", result.stdout, re.MULTILINE)
    assert len(passed) == CEL_CASES, result.stdout
