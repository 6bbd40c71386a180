"""Who may take part in a parallel group (``engine/parallel/rendezvous.py``).

The defect pinned here: a one-pod tensor-parallel replica's ``TCPStore`` listened on every
interface (``::``/``0.0.0.0``), and the ranks unpickled whatever arrived on the group's control
channel, so whoever reached the pod's rendezvous port was close to running code in every rank.
Now a real two-rank group on the CPU opens no listening socket beyond loopback (read from
``/proc/net/tcp*`` for the server process and its worker), every control message is sealed
with an HMAC that is checked before anything is unpickled (a payload that would run code is
refused with a bad, missing or replayed MAC, and never decoded), a group of pods keyed by
``--rendezvous-key-file`` forms and talks, a rank holding another group's key refuses the
driver's first message, and a keyless group of pods is refused unless it meets on loopback.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_to_completion
from torch._C._distributed_c10d import TCPStore

from splitserve_contract import ServeArgs
from splitserve_e2e.net import free_port
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.parallel import rendezvous
from splitserve_runtime.engine.parallel.group import ParallelGroup, init_group
from splitserve_runtime.engine.parallel.placement import PlacementError, resolve_placement
from splitserve_runtime.engine.parallel.rendezvous import ControlAuthError, ControlCodec
from splitserve_runtime.engine.parallel.runner import ParallelRunner
from splitserve_runtime.engine.sampling_params import SamplingParams

BASE = ServeArgs(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=64,
    max_model_len=128,
    max_num_batched_tokens=128,
    prefix_caching=False,
    chunked_prefill=False,
)


# ----------------------------------------------------------------------------- listening sockets
def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The local address of a /proc/net/tcp{,6} line (32-bit words in host byte order)."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    packed = b"".join(words)
    return ipaddress.IPv4Address(packed) if len(packed) == 4 else ipaddress.IPv6Address(packed)


def _listening(inodes: set[str]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket among ``inodes``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN
                    address, port = fields[1].split(":")
                    found.append((str(_address(address)), int(port, 16)))
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_a_one_pod_group_listens_on_loopback_only(tiny_llama_dir: Path) -> None:
    before = _socket_inodes(os.getpid())
    engine = LLMEngine.from_args(dataclasses.replace(BASE, model=str(tiny_llama_dir), tensor_parallel_size=2))
    try:
        runner = engine.runner
        assert isinstance(runner, ParallelRunner)
        (worker,) = runner.workers.processes
        opened = _listening(_socket_inodes(os.getpid()) - before) + _listening(_socket_inodes(worker.pid))
        store = runner.group.store
        assert isinstance(store, TCPStore)
        assert store.port in {port for _, port in opened}, opened  # the store is among them
        exposed = [(address, port) for address, port in opened if not _is_loopback(address)]
        assert not exposed, f"the group listens beyond loopback: {exposed} (all: {opened})"
        # and the group still works: two ranks, sealed control messages
        tokens = run_to_completion(
            engine, {"a": [1, 2, 3, 4, 5]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        assert len(tokens["a"]) == 4
    finally:
        engine.close()
    assert worker.returncode == 0  # a Stop message it could authenticate, not a kill


# ----------------------------------------------------------------------------- the codec
RAN: list[str] = []


def _ran(what: str) -> None:
    RAN.append(what)


class _Payload:
    """Unpickling this runs code (what an attacker would send)."""

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return _ran, ("unpickled",)


def _open_and_decode(codec: ControlCodec, frame: bytes, *, sender: int = 0, sequence: int = 0) -> Any:
    return pickle.loads(codec.open(frame, sender=sender, sequence=sequence))


def test_a_control_message_is_refused_before_decoding_without_the_groups_mac() -> None:
    RAN.clear()
    key = bytes(range(32))
    mine, foreign = ControlCodec(key), ControlCodec(bytes(32))
    payload = pickle.dumps(_Payload())
    good = mine.seal(payload, sender=0, sequence=0)

    refused = {
        "raw pickle, no MAC": payload,
        "empty": b"",
        "another key": foreign.seal(payload, sender=0, sequence=0),
        "payload altered": good[:-1] + bytes([good[-1] ^ 1]),
        "MAC altered": bytes([good[0] ^ 1]) + good[1:],
        "truncated": good[:40],
    }
    for what, frame in refused.items():
        with pytest.raises(ControlAuthError, match="refused|too short"):
            _open_and_decode(mine, frame)
        assert RAN == [], f"{what}: decoded before it was authenticated"
    # replayed or misattributed: a genuine message is good for its own slot only
    with pytest.raises(ControlAuthError, match="replayed or out of step"):
        _open_and_decode(mine, good, sequence=1)
    with pytest.raises(ControlAuthError, match="replayed or out of step"):
        _open_and_decode(mine, good, sender=1)
    assert RAN == []
    # the control: the same payload, sealed by the group, is decoded (and would run)
    _open_and_decode(mine, good)
    assert RAN == ["unpickled"]


def test_keys_are_per_group_and_a_keyless_group_of_pods_meets_on_loopback_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "key"
    secret.write_bytes(os.urandom(32))
    args = dataclasses.replace(ServeArgs(), tensor_parallel_size=2, nnodes=2, rendezvous_key_file=str(secret))
    env = {"LWS_GROUP_SIZE": "2"}

    def meeting(group_args: ServeArgs, *, node: int, leader: str) -> rendezvous.Rendezvous:
        placement = resolve_placement(dataclasses.replace(group_args, node_rank=node, leader_address=leader), env=env)
        return rendezvous.multinode(group_args, placement)

    leader, worker = (
        meeting(args, node=0, leader="chat-engine-0.chat-engine-0.ns"),
        meeting(args, node=1, leader="chat-engine-0.chat-engine-0.ns"),
    )
    assert leader.key == worker.key and leader.authenticated and not leader.loopback
    assert leader.store_host is None  # the other pods reach it: every interface, under the key
    other_group = meeting(args, node=1, leader="chat-engine-1.chat-engine-1.ns")
    assert other_group.key != leader.key
    assert secret.read_bytes() not in leader.key and len(leader.key) == 32

    keyless = dataclasses.replace(args, rendezvous_key_file="")
    with pytest.raises(PlacementError, match="--rendezvous-key-file"):
        meeting(keyless, node=1, leader="chat-engine-0.chat-engine-0.ns")
    with pytest.raises(PlacementError, match="--rendezvous-key-file"):
        meeting(keyless, node=0, leader="10.0.0.7")
    with caplog.at_level(logging.WARNING):
        local = meeting(keyless, node=1, leader="127.0.0.2")
    assert (local.authenticated, local.loopback, local.store_host) == (False, True, "127.0.0.2")
    assert "not authenticated" in caplog.text

    short = tmp_path / "short"
    short.write_bytes(b"0123456789\n")
    with pytest.raises(PlacementError, match="holds 10 bytes") as refused:
        meeting(dataclasses.replace(args, rendezvous_key_file=str(short)), node=0, leader="grp")
    assert "0123456789" not in str(refused.value)


# ----------------------------------------------------------------------------- a keyed group of two
def _two_ranks(meetings: list[rendezvous.Rendezvous], port: int) -> list[ParallelGroup]:
    """Ranks 0 and 1 of one TP 2 group (gloo on the CPU), joined from two threads."""
    groups: dict[int, ParallelGroup] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            groups[rank] = init_group(
                rank=rank,
                tp_size=2,
                num_stages=1,
                init_method=f"tcp://127.0.0.1:{port}",
                device=torch.device("cpu"),
                rendezvous=meetings[rank],
            )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return [groups[0], groups[1]]


def _both(driver: Callable[[], Any], worker: Callable[[], Any]) -> tuple[Any, Any]:
    """Run the two ranks' sides of one collective at once; the worker's exception is returned."""
    out: dict[str, Any] = {}

    def run_worker() -> None:
        try:
            out["worker"] = worker()
        except BaseException as exc:  # the test looks at it
            out["worker"] = exc

    thread = threading.Thread(target=run_worker)
    thread.start()
    out["driver"] = driver()
    thread.join(timeout=60)
    return out["driver"], out["worker"]


def test_a_group_keyed_from_the_key_file_works_and_refuses_another_groups_driver(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_bytes(os.urandom(32))
    port = free_port()
    args = dataclasses.replace(
        ServeArgs(), tensor_parallel_size=2, nnodes=2, rendezvous_port=port, rendezvous_key_file=str(secret)
    )

    def meeting(node: int, leader: str) -> rendezvous.Rendezvous:
        placement = resolve_placement(dataclasses.replace(args, node_rank=node, leader_address=leader), env={})
        return rendezvous.multinode(args, placement)

    ranks = _two_ranks([meeting(0, "grp-0.ns"), meeting(1, "grp-0.ns")], port)
    driver, worker = ranks
    assert _both(lambda: driver.broadcast_object({"step": [1, 2, 3]}), worker.broadcast_object) == (
        {"step": [1, 2, 3]},
        {"step": [1, 2, 3]},
    )
    gathered = _both(lambda: driver.all_gather_object(("rank", 0)), lambda: worker.all_gather_object(("rank", 1)))
    assert gathered == ([("rank", 0), ("rank", 1)], [("rank", 0), ("rank", 1)])

    # a rank holding another group's key (same secret, another leader) takes nothing from this driver
    RAN.clear()
    port = free_port()
    args = dataclasses.replace(args, rendezvous_port=port)
    driver, stranger = _two_ranks([meeting(0, "grp-0.ns"), meeting(1, "grp-1.ns")], port)
    _, refused = _both(lambda: driver.broadcast_object(_Payload()), stranger.broadcast_object)
    assert isinstance(refused, ControlAuthError), refused
    assert RAN == []  # never unpickled


# ----------------------------------------------------------------------------- two pods, keyed
def test_two_pods_keyed_by_the_key_file_serve_and_a_keyless_pod_beyond_loopback_is_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """``splitserve serve`` as the two pods of a LeaderWorkerSet group (two loopback addresses),
    both given the Secret's file: the worker pod's rank joins under the derived key and the
    leader answers. A keyless worker pod told to join a leader by name refuses to start."""
    import httpx
    from server_harness import MODEL_NAME, serve_args, serve_until_exit, spawn_server, wait_until

    secret = tmp_path / "key"
    secret.write_bytes(os.urandom(32))
    args = serve_args(
        model_dir=tiny_llama_dir,
        nnodes=2,
        tensor_parallel_size=2,
        rendezvous_port=free_port(),
        rendezvous_key_file=str(secret),
    )
    env = {"LWS_LEADER_ADDRESS": "127.0.0.2", "LWS_GROUP_SIZE": "2"}
    ports = [free_port(), free_port()]
    pods = [
        spawn_server(args=dataclasses.replace(args, host=host, port=port), env={**env, "LWS_WORKER_INDEX": str(index)})
        for index, (host, port) in enumerate(zip(("127.0.0.2", "127.0.0.3"), ports, strict=True))
    ]
    try:

        def ready(host: str, port: int) -> bool:
            for pod in pods:
                assert pod.poll() is None, pod.communicate()[0]
            try:
                return httpx.get(f"http://{host}:{port}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(
            lambda: ready("127.0.0.2", ports[0]) and ready("127.0.0.3", ports[1]),
            timeout_s=150,
            what="the keyed group to become ready",
        )
        answer = httpx.post(
            f"http://127.0.0.2:{ports[0]}/v1/completions",
            timeout=60,
            json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        for pod in pods:
            pod.kill()
            pod.communicate(timeout=30)

    code, output, message = serve_until_exit(
        args=dataclasses.replace(
            args, rendezvous_key_file="", node_rank=1, leader_address="chat-engine-0.ns", port=free_port()
        ),
        termination_log=tmp_path / "termination-log",
    )
    assert code != 0, output
    assert "--rendezvous-key-file" in message, (message, output)
