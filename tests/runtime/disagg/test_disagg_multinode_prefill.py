"""A prefill replica spread over two pods hands each rank's KV to the decode pod, as real processes.

Why: a model too big for one node is prefilled by a LeaderWorkerSet group (``--nnodes 2``),
and there rank 1 lives in another pod, with another IP: it must serve its (layer, KV head)
slice on *its* pod's address at ``--kv-port`` + its index within that pod (0), and the signed
handoff parameters must name that endpoint, or the decode pod pulls half a cache from nowhere
(and falls back to computing the prompt). test_disagg_parallel.py covers ranks inside one pod
only. Here the two prefill "pods" are two process trees on their own loopback addresses
(leader 127.0.0.2, worker pod 127.0.0.3, both with the same ``--kv-port`` as one pod template
gives them), meeting at the leader's rendezvous port as in test_multinode_parallel.py; a TP 1
decode pod and the bundled router complete the deployment, all sharing one handoff key.

The completions through the router equal the aggregated single-process engine's; the signed
``kv_layout`` names rank 1's endpoint on the worker pod's address; the decode pod receives every
rank's slice of every block (two pieces per block) while the leader's own endpoint sends only
rank 0's slice, so the other half came from the worker pod; and nothing fell back: no transfer
failure, no prompt token computed on the decode pod, no fallback warning in its log.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from disagg_harness import (
    BLOCK_SIZE,
    COMPAT_HASH,
    MODEL_NAME,
    START_TIMEOUT_SECONDS,
    Cluster,
    Proc,
    Reference,
    free_port,
    serve_args,
    wait_for,
)

from splitserve_contract import KV_TRANSFER_PARAMS_FIELD, Metric, Role, ServeArgs, serve_argv
from splitserve_contract.model_config import load_model_config
from splitserve_runtime.transfer import KVLayout, KVSlice
from splitserve_runtime.transfer.framing import BLOCK_HEADER_SIZE, BLOCK_INDEX

LEADER_HOST, WORKER_HOST, DECODE_HOST = "127.0.0.2", "127.0.0.3", "127.0.0.4"
ROUTER_OCTET = 5
ROUTED_PROMPT = (
    "Once upon a time in a land far away there lived a king who had three daughters, "
    "and the youngest of them was the cleverest of all"
)
HANDED_PROMPT = (
    "The quick brown fox jumps over the lazy dog while the old cat sleeps by the fire "
    "and dreams of the mice it caught long ago"
)
MAX_TOKENS = 16
FALLBACK_LOG = "computing the prompt on this pod"
"""The decode pod's warning when a pull failed and it computes the prompt itself (remote.py)."""


@dataclasses.dataclass(frozen=True)
class Deployment:
    """The prefill group's two pods, the decode pod and the router, all started and ready."""

    leader: Proc
    worker: Proc
    decode: Proc
    router: Proc
    kv_port: int
    """Both prefill pods' ``--kv-port`` (one pod template)."""


def _kv_port_free_on(*hosts: str) -> int:
    """A port free on every one of ``hosts`` (each pod binds it on its own address)."""
    for _ in range(50):
        port: int = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port free on all of {hosts}")


def _pod(name: str, args: ServeArgs, *, log_dir: Path) -> Proc:
    port = free_port(args.host)
    argv = [sys.executable, "-m", "splitserve_cli", "serve", *serve_argv(dataclasses.replace(args, port=port))]
    return Proc(name=name, host=args.host, port=port, kv_port=args.kv_port, argv=argv, log_path=log_dir / f"{name}.log")


def _wait_ready(procs: list[Proc]) -> None:
    def all_ready() -> bool:
        for proc in procs:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited while starting:\n{proc.log_tail()}")
        return all(proc.ready() for proc in procs)

    try:
        wait_for(all_ready, timeout_seconds=START_TIMEOUT_SECONDS, what="the pods to become ready")
    except AssertionError as exc:
        raise AssertionError("\n".join([str(exc), *(f"{p.name}:\n{p.log_tail()}" for p in procs)])) from None


@pytest.fixture
def deployment(model_dir: Path, tmp_path: Path) -> Iterator[Deployment]:
    key_file = tmp_path / "handoff.key"
    key_file.write_text("multinode-prefill-handoff-key-0123456789\n")
    key_file.chmod(0o600)
    kv_port = _kv_port_free_on(LEADER_HOST, WORKER_HOST)
    pool = {"compat_hash": COMPAT_HASH, "handoff_key_file": str(key_file)}
    group = serve_args(
        model_dir=model_dir,
        role=Role.PREFILL.value,
        tensor_parallel_size=2,
        nnodes=2,
        rendezvous_port=free_port(LEADER_HOST),
        kv_port=kv_port,
        **pool,
    )
    leader = _pod("prefill-leader", dataclasses.replace(group, host=LEADER_HOST, node_rank=0), log_dir=tmp_path)
    worker = _pod(
        "prefill-worker",
        dataclasses.replace(group, host=WORKER_HOST, node_rank=1, leader_address=LEADER_HOST),
        log_dir=tmp_path,
    )
    decode = _pod(
        "decode",
        serve_args(
            model_dir=model_dir, role=Role.DECODE.value, host=DECODE_HOST, kv_port=free_port(DECODE_HOST), **pool
        ),
        log_dir=tmp_path,
    )
    # the router is rendered by the harness; it sees the group's leader only (the worker pod serves no API)
    router = Cluster(model_dir=model_dir, log_dir=tmp_path, prefill=[leader], decode=[decode]).router_proc(
        policy="PrefixAffinity", octet=ROUTER_OCTET
    )
    started: list[Proc] = []
    try:
        for proc in (worker, leader, decode):
            proc.start()
            started.append(proc)
        _wait_ready([leader, worker, decode])
        router.start()  # after the pods: its first poll finds them healthy
        started.append(router)
        _wait_ready([router])
        yield Deployment(leader=leader, worker=worker, decode=decode, router=router, kv_port=kv_port)
    finally:
        for proc in reversed(started):
            proc.kill()


def _wire_layout(model_dir: Path) -> KVLayout:
    """The whole-model wire layout of the pods' blocks (the harness's float32 cache and block size)."""
    config = load_model_config(model_dir=model_dir)
    return KVLayout(
        num_layers=config.num_hidden_layers,
        block_size=BLOCK_SIZE,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype="float32",
        dtype_bytes=4,
        compat_hash=COMPAT_HASH,
    )


def _handoff(leader: Proc, body: dict[str, Any]) -> dict[str, Any]:
    """The router's first hop, made by hand: the leader's signed handoff parameters."""
    response = httpx.post(
        f"{leader.url}/v1/completions",
        timeout=60,
        json={**body, "max_tokens": 1, KV_TRANSFER_PARAMS_FIELD: {"do_remote_decode": True}},
    )
    assert response.status_code == 200, response.text
    params: dict[str, Any] = response.json()[KV_TRANSFER_PARAMS_FIELD]
    return params


def _decode_with(decode: Proc, body: dict[str, Any], params: dict[str, Any]) -> str:
    """The router's second hop, made by hand: the decode pod's completion."""
    response = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={**body, KV_TRANSFER_PARAMS_FIELD: params})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_a_prefill_replica_over_two_pods_hands_every_ranks_kv_to_a_tp1_decode_pod(
    deployment: Deployment, reference: Reference, model_dir: Path
) -> None:
    leader, decode = deployment.leader, deployment.decode
    layout = _wire_layout(model_dir)

    # the production path: the router prefills on the group's leader, the decode pod pulls
    routed_ids = reference.tokenizer.encode(ROUTED_PROMPT)
    want_routed, _ = reference.generate(routed_ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    client = openai.OpenAI(base_url=f"{deployment.router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.completions.create(
        model=MODEL_NAME, prompt=ROUTED_PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text == want_routed
    routed_blocks = -(-len(routed_ids) // layout.block_size)
    # every block whole (two pieces, each with its block index): rank 1's half came too
    assert decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL) == routed_blocks * (layout.block_nbytes + 2 * BLOCK_INDEX.size)

    # the same hops by hand, to read what the leader signed for the decode pod
    handed_ids = reference.tokenizer.encode(HANDED_PROMPT)
    want_handed, _ = reference.generate(handed_ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    body = {
        "model": MODEL_NAME,
        "prompt": HANDED_PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    params = _handoff(leader, body)
    ranks = params["kv_layout"]["ranks"]
    assert [rank["endpoint"] for rank in ranks] == [
        f"{LEADER_HOST}:{deployment.kv_port}",
        f"{WORKER_HOST}:{deployment.kv_port}",
    ]  # index 0 in its pod
    held = [KVSlice.from_json(rank) for rank in ranks]
    assert held[0].intersect(held[1]) is None and sum(part.num_heads for part in held) == layout.num_kv_heads
    received = decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL)
    assert _decode_with(decode, body, params) == want_handed
    handed_blocks = -(-len(handed_ids) // layout.block_size)
    assert decode.metric(Metric.KV_TRANSFER_BYTES_TOTAL) - received == sum(
        handed_blocks * (part.block_nbytes(layout) + BLOCK_INDEX.size) for part in held
    )

    # the leader's own endpoint sent rank 0's slice only: the rest left from the worker pod
    rank0_sent = (routed_blocks + handed_blocks) * (BLOCK_HEADER_SIZE + held[0].block_nbytes(layout))
    assert leader.metric(Metric.KV_TRANSFER_BYTES_TOTAL) == rank0_sent
    # no fallback: nothing failed, and the decode pod computed no prompt token
    assert decode.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == 0
    assert leader.metric(Metric.KV_TRANSFER_FAILURES_TOTAL) == 0
    assert decode.metric(Metric.ENGINE_PREFILL_TOKENS_TOTAL) == 0
    assert FALLBACK_LOG not in decode.log_tail(num_chars=1_000_000)
    assert deployment.worker.ready()  # and the group is still whole
