"""What the operator renders for pools of different parallel layouts to exchange KV. The compat
hash pairs prefill and decode pods whose KV blocks are interchangeable: it covers what must
match (model, revision, dtype, quantization, KV block size, KV cache dtype, image) and not what
may differ (each pool's tensor- and pipeline-parallel sizes: KV moves rank to rank in slices of
the whole-model layout, so a TP 2 prefill pool feeds a TP 1 decode pool). And the prefill pods'
NetworkPolicy lets decode pods reach every rank's KV port (the KV port + the rank's index)."""

from __future__ import annotations

from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_operator.api import InferenceService
from splitserve_operator.render import compat_hash_of, render_children

IMAGE = "registry.example/splitserve:1.2.3"


def _isvc(**spec: Any) -> InferenceService:
    base: dict[str, Any] = {
        "model": {"uri": "hf://meta/llama-3", "dtype": "bfloat16"},
        "mode": "Disaggregated",
        "prefill": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 4}},
        "decode": {"replicas": {"min": 1, "max": 2}, "resources": {"gpus": 4}},
    }
    base.update(spec)
    return InferenceService.parse(
        {
            "apiVersion": "splitserve.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "team-a", "uid": "uid-1", "generation": 1},
            "spec": base,
        }
    )


def _hash(**spec: Any) -> str:
    return compat_hash_of(isvc=_isvc(**spec), runtime_image=IMAGE)


def _pool(tensor: int, pipeline: int) -> dict[str, Any]:
    return {
        "replicas": {"min": 1, "max": 2},
        "resources": {"gpus": 4},
        "parallelism": {"tensor": tensor, "pipeline": pipeline},
    }


def test_parallel_layouts_do_not_enter_the_hash() -> None:
    plain = _hash()
    assert _hash(prefill=_pool(2, 1), decode=_pool(1, 1)) == plain
    assert _hash(prefill=_pool(1, 1), decode=_pool(2, 2)) == plain
    assert _hash(prefill=_pool(4, 1), decode=_pool(1, 4)) == plain


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"uri": "hf://meta/llama-3.1", "dtype": "bfloat16"}},
        {"model": {"uri": "hf://meta/llama-3", "dtype": "float16"}},
        {"model": {"uri": "hf://meta/llama-3", "dtype": "bfloat16", "revision": "abc123"}},
        {"kvCache": {"blockSize": 32}},
        {"kvCache": {"dtype": "fp8"}},
        {"runtime": {"image": "registry.example/splitserve:1.2.4"}},
    ],
    ids=["model", "dtype", "revision", "block-size", "kv-cache-dtype", "image"],
)
def test_what_the_blocks_depend_on_enters_the_hash(change: dict[str, Any]) -> None:
    assert _hash(**change) != _hash()


@pytest.mark.parametrize(("tensor", "pipeline", "ranks"), [(1, 1, 1), (2, 1, 2), (2, 2, 4)])
def test_decode_pods_may_reach_every_prefill_rank_s_kv_port(tensor: int, pipeline: int, ranks: int) -> None:
    objs = render_children(
        isvc=_isvc(prefill=_pool(tensor, pipeline)), runtime_image=IMAGE, router_service_account="splitserve-router"
    )
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "llama-prefill")
    kv = [
        port
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
        if port.get("port") == contract.KV_TRANSFER_PORT
    ]
    want = {"protocol": "TCP", "port": contract.KV_TRANSFER_PORT}
    assert kv == [want if ranks == 1 else {**want, "endPort": contract.KV_TRANSFER_PORT + ranks - 1}]
