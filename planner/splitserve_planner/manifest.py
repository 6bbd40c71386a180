"""An InferenceService manifest (splitserve.dev/v1alpha1) for a chosen plan.

Built as a plain dict and validated with the operator's own API models
(:meth:`splitserve_operator.api.InferenceService.parse`) before it is written, so a plan never
emits a manifest the CRD would reject; settings this version does not serve
(:mod:`splitserve_contract.capabilities`) are refused before that, with the capabilities
table's message, even when ``splitserve plan --what-if`` priced them. Each pod gets the plan's
tensor-parallel size as both ``parallelism.tensor`` and ``resources.gpus``. The
precision the plan was priced at is written as ``spec.model.dtype``, ``spec.model.quantization``
and, for an fp8 KV cache only, ``spec.kvCache.dtype`` (``auto``, the API default, is left out);
speculative decoding, when planned with it, as ``spec.scheduling.speculative`` (method, numTokens,
maxNumSeqs; the acceptance is a property of the workload, not a setting, and is not written).
Replica bounds: ``max`` is the planned count at the peak rate; ``min`` the (analytic) count for the off-peak rate, so the autoscaler can shrink the
fleet when traffic falls. ``autoscaling.gpuBudget`` caps both pools at the planned peak.
"""

from __future__ import annotations

from typing import Any

import yaml

from splitserve_operator.api import InferenceService

from .precision import Precision
from .search import Plan
from .simulator import AGGREGATED
from .speculation import NO_SPECULATION, Speculation
from .supported import check_servable

ROUTER_POLICY_NAMES = {
    "prefix-affinity": "PrefixAffinity",
    "least-load": "LeastLoad",
    "round-robin": "RoundRobin",
    "central-queue": "LeastLoad",
}


def build_manifest(
    *,
    plan: Plan,
    name: str,
    model_uri: str,
    precision: Precision,
    min_replicas: dict[str, int],
    router_policy: str,
    memory_fraction: float,
    max_num_seqs: int,
    block_size: int,
    speculation: Speculation = NO_SPECULATION,
) -> dict[str, Any]:
    """The manifest dict (validated; raises :class:`~splitserve_contract.capabilities.UnsupportedError`
    for a setting this version does not serve, :class:`~splitserve_operator.api.InvalidSpecError`
    for anything else the API refuses)."""
    tp = plan.gpus_per_replica
    check_servable(tensor_parallel=tp, precision=precision)

    def pool(*, role: str, count: int) -> dict[str, Any]:
        low = max(1, min(count, min_replicas.get(role, 1)))
        return {"replicas": {"min": low, "max": count}, "resources": {"gpus": tp}, "parallelism": {"tensor": tp}}

    model: dict[str, Any] = {"uri": model_uri, "dtype": precision.dtype, "quantization": precision.quantization}
    kv_cache: dict[str, Any] = {
        "blockSize": block_size,
        "memoryFraction": memory_fraction,
        "prefixCaching": plan.prefix_caching,
    }
    if precision.kv_cache_dtype != "auto":
        kv_cache["dtype"] = precision.kv_cache_dtype
    spec: dict[str, Any] = {
        "model": model,
        "mode": "Aggregated" if plan.mode == AGGREGATED else "Disaggregated",
        "router": {"policy": ROUTER_POLICY_NAMES[router_policy]},
        "kvCache": kv_cache,
        "scheduling": {"maxNumSeqs": max_num_seqs, "maxBatchedTokens": plan.max_batched_tokens, "chunkedPrefill": True},
        "autoscaling": {"enabled": True, "gpuBudget": plan.num_gpus},
    }
    if speculation.enabled:
        spec["scheduling"]["speculative"] = {
            "method": speculation.method,
            "numTokens": speculation.num_tokens,
            "maxNumSeqs": speculation.max_num_seqs,
        }
    if plan.mode == AGGREGATED:
        spec["aggregated"] = pool(role="aggregated", count=plan.aggregated_replicas)
    else:
        spec["prefill"] = pool(role="prefill", count=plan.prefill_replicas)
        spec["decode"] = pool(role="decode", count=plan.decode_replicas)
    manifest = {
        "apiVersion": "splitserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "annotations": {"splitserve.dev/planned-by": "splitserve plan"}},
        "spec": spec,
    }
    InferenceService.parse(manifest)
    return manifest


def manifest_yaml(manifest: dict[str, Any], *, header: str) -> str:
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(manifest, sort_keys=False)
