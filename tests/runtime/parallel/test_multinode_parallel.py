"""One replica's ranks spread over a group of pods (``--nnodes``), with real processes on loopback.

Two "pods" are two process trees listening on different loopback addresses (the leader on
127.0.0.2, the worker pod on 127.0.0.3), meeting at the leader's rendezvous port like the pods
of a LeaderWorkerSet group: the leader's OpenAI API answers exactly what one process answers
(TP 2 and PP 2 over two pods of one rank each), the worker pod answers the kubelet's probes,
waits for a leader that starts after it, and either pod's death takes the other down within
seconds with a non-zero status and a termination message (never a hang behind a collective).
The placement rules (flags, LeaderWorkerSet environment, clear refusals) and the heartbeat
(a real store; a silent pod, a reported failure, a store that goes away) are checked in-process.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import (
    MODEL_NAME,
    serve_args,
    serve_until_exit,
    spawn_server,
    start_server,
    wait_until,
)
from torch._C._distributed_c10d import TCPStore

from splitserve_contract import ServeArgs
from splitserve_e2e.net import free_port
from splitserve_runtime.engine.parallel import liveness
from splitserve_runtime.engine.parallel.launcher import WORKER_EXIT_STATUS
from splitserve_runtime.engine.parallel.placement import (
    ENV_GROUP_SIZE,
    ENV_LEADER_ADDRESS,
    ENV_WORKER_INDEX,
    PlacementError,
    resolve_placement,
)
from splitserve_runtime.termination import TERMINATION_LOG_ENV

PROMPTS = ["Once upon a time", "The quick brown fox", "In a land far away there"]
LEADER_HOST, WORKER_HOST = "127.0.0.2", "127.0.0.3"
EXIT_WITHIN_S = 8.0
"""A pod notices its peer's death within this (a ping or a closed connection: about 2 s)."""


# ----------------------------------------------------------------------------- placement


def _placement_args(**overrides: object) -> ServeArgs:
    return dataclasses.replace(ServeArgs(), **overrides)  # type: ignore[arg-type]


def test_placement_from_flags_or_the_leaderworkerset_environment() -> None:
    one = resolve_placement(_placement_args(tensor_parallel_size=2), env={})
    assert (one.nnodes, one.node_rank, list(one.local_ranks), one.is_multinode) == (1, 0, [0, 1], False)

    env = {ENV_LEADER_ADDRESS: "grp-0.grp.ns", ENV_GROUP_SIZE: "2", ENV_WORKER_INDEX: "1"}
    worker = resolve_placement(_placement_args(tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2), env=env)
    assert (worker.node_rank, worker.ranks_per_node, list(worker.local_ranks)) == (1, 4, [4, 5, 6, 7])
    assert worker.init_method() == "tcp://grp-0.grp.ns:29500"
    assert [worker.local_index(rank) for rank in worker.local_ranks] == [0, 1, 2, 3]  # devices 0..3 of its pod
    assert worker.describe_node(1) == "node 1 (ranks 4-7)"

    flags_win = resolve_placement(
        _placement_args(tensor_parallel_size=2, nnodes=2, node_rank=0, rendezvous_port=31000), env=env
    )
    assert flags_win.is_leader and flags_win.init_method() == "tcp://127.0.0.1:31000"
    ipv6 = resolve_placement(
        _placement_args(tensor_parallel_size=2, nnodes=2, node_rank=1, leader_address="fd00::1"), env={}
    )
    assert ipv6.init_method() == "tcp://[fd00::1]:29500"


@pytest.mark.parametrize(
    ("overrides", "env", "expected"),
    [
        ({"tensor_parallel_size": 3, "nnodes": 2}, {}, "--nnodes 2 must divide tensor × pipeline = 3 × 1 = 3"),
        ({"nnodes": 2}, {}, "must divide tensor × pipeline = 1 × 1 = 1"),
        (
            {"tensor_parallel_size": 2, "nnodes": 2},
            {ENV_WORKER_INDEX: "1"},
            "neither --leader-address nor $LWS_LEADER_ADDRESS",
        ),
        ({"tensor_parallel_size": 2, "nnodes": 2}, {ENV_GROUP_SIZE: "4"}, "$LWS_GROUP_SIZE=4"),
        ({"tensor_parallel_size": 2}, {ENV_GROUP_SIZE: "2"}, "but --nnodes 1"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2}, {}, "node rank 2 is outside a group of --nnodes 2"),
        ({"nnodes": 0}, {}, "--nnodes must be at least 1"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, {ENV_WORKER_INDEX: "one"}, "$LWS_WORKER_INDEX must be an integer"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "rendezvous_port": 0}, {}, "--rendezvous-port must be a TCP port"),
    ],
    ids=[
        "tp-not-divisible",
        "no-parallelism",
        "worker-without-leader",
        "group-size-mismatch",
        "lws-group-without-nnodes",
        "node-rank-too-big",
        "zero-nodes",
        "bad-env",
        "bad-port",
    ],
)
def test_placement_refuses_what_cannot_form_a_group(
    overrides: dict[str, object], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(PlacementError) as refused:
        resolve_placement(_placement_args(**overrides), env=env)
    assert expected in str(refused.value)


def test_serve_refuses_a_group_size_mismatch_before_loading(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_GROUP_SIZE, "3")  # the server's environment
    args = serve_args(model_dir=tiny_llama_dir, tensor_parallel_size=2, nnodes=2)
    code, output, message = serve_until_exit(args=args, termination_log=tmp_path / "termination-log", timeout_s=60)
    assert code == 2, output
    assert "$LWS_GROUP_SIZE=3 (pods in this LeaderWorkerSet group) but --nnodes 2" in message


# ----------------------------------------------------------------------------- liveness


@pytest.fixture
def store() -> Iterator[TCPStore]:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=liveness.STORE_TIMEOUT)
    yield master


class _Lost:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def _heartbeat(
    store: TCPStore, *, node: int, peers: list[int], lost: _Lost, wait_for_first_beat: bool = False
) -> liveness.Heartbeat:
    return liveness.Heartbeat(
        host="127.0.0.1",
        port=store.port,
        node=node,
        peers=peers,
        describe=lambda n: f"node {n}",
        on_lost=lost,
        wait_for_first_beat=wait_for_first_beat,
        beat_s=0.05,
        peer_timeout_s=0.5,
    ).start()


def test_heartbeats_keep_a_group_alive_and_a_silent_pod_is_lost(store: TCPStore) -> None:
    leader_lost, worker_lost = _Lost(), _Lost()
    leader = _heartbeat(store, node=0, peers=[1, 2], lost=leader_lost)
    one = _heartbeat(store, node=1, peers=[0], lost=worker_lost, wait_for_first_beat=True)
    silent_since = time.monotonic()  # node 2 never beats
    assert leader_lost.event.wait(5)
    assert time.monotonic() - silent_since < 3
    assert leader_lost.reasons == [leader_lost.reasons[0]]
    assert "node 2 sent no heartbeat" in leader_lost.reasons[0]
    assert not worker_lost.event.is_set()  # node 0 beat all along
    leader.stop()
    assert worker_lost.event.wait(5)
    assert "node 0 sent no heartbeat" in worker_lost.reasons[0]
    one.stop()


def test_a_reported_failure_reaches_every_pod_and_a_gone_store_is_a_gone_leader(store: TCPStore) -> None:
    leader_lost, worker_lost = _Lost(), _Lost()
    _heartbeat(store, node=0, peers=[1], lost=leader_lost)
    worker = _heartbeat(store, node=1, peers=[0], lost=worker_lost, wait_for_first_beat=True)
    worker.report("node 1 (rank 1): parallel rank 1 exited with status -9")
    worker.report("a later symptom")  # the first report is the cause
    assert leader_lost.event.wait(5)
    assert leader_lost.reasons[0] == "the group failed: node 1 (rank 1): parallel rank 1 exited with status -9"

    lonely_lost = _Lost()
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=liveness.STORE_TIMEOUT)
    _heartbeat(master, node=1, peers=[0], lost=lonely_lost, wait_for_first_beat=True)
    del master  # the leader's process (the store's host) is gone
    assert lonely_lost.event.wait(5)
    assert "the group's store" in lonely_lost.reasons[0] and "the leader is gone" in lonely_lost.reasons[0]


def test_a_worker_pod_waits_for_its_leader_bounded() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(
        TimeoutError, match=rf"the group's leader 127.0.0.2:{port} did not accept connections within 1 s"
    ):
        liveness.wait_for_leader("127.0.0.2", port, timeout_s=1.0)
    assert time.monotonic() - started < 4

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def come_up() -> None:
        time.sleep(0.5)
        listener.bind(("127.0.0.2", port))
        listener.listen()

    threading.Thread(target=come_up).start()
    liveness.wait_for_leader("127.0.0.2", port, timeout_s=30.0)
    listener.close()


# ----------------------------------------------------------------------------- two pods


class _Pod:
    """``splitserve serve`` as one pod of the group, on its own loopback address."""

    def __init__(self, args: ServeArgs, *, host: str, termination_log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base = f"http://{host}:{self.port}"
        self.termination_log = termination_log
        termination_log.write_text("")
        self.proc = spawn_server(
            args=dataclasses.replace(args, host=host, port=self.port),
            env={TERMINATION_LOG_ENV: str(termination_log), **env},
        )

    def status(self, path: str) -> int | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.base} exited with {self.proc.returncode}:\n{self.output()}")
        try:
            return httpx.get(f"{self.base}{path}", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def children(self) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    def exit_code_within(self, seconds: float) -> tuple[int, float]:
        started = time.monotonic()
        code = self.proc.wait(timeout=seconds + 20)
        return code, time.monotonic() - started

    def output(self) -> str:
        if self.proc.poll() is None or self.proc.stdout is None:
            return ""
        return str(self.proc.stdout.read())

    def close(self) -> None:
        for pid in self.children():
            subprocess.run(["kill", "-9", str(pid)], check=False)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def one_process_answers(tiny_llama_dir: Path) -> list[str]:
    with start_server(args=serve_args(model_dir=tiny_llama_dir)) as single:
        return _answers(single.base_url)


def _answers(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    return [
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for prompt in PROMPTS
    ]


@pytest.fixture
def pods() -> Iterator[list[_Pod]]:
    started: list[_Pod] = []
    yield started
    for pod in started:
        pod.close()


def _group_args(model_dir: Path, **layout: int) -> ServeArgs:
    args: ServeArgs = serve_args(model_dir=model_dir, nnodes=2, rendezvous_port=free_port(), **layout)
    return args


def _start_worker(pods: list[_Pod], args: ServeArgs, tmp_path: Path) -> _Pod:
    """Node 1, told its place by the LeaderWorkerSet environment only."""
    env = {ENV_LEADER_ADDRESS: LEADER_HOST, ENV_GROUP_SIZE: "2", ENV_WORKER_INDEX: "1"}
    pod = _Pod(args, host=WORKER_HOST, termination_log=tmp_path / "worker-termination-log", env=env)
    pods.append(pod)
    return pod


def _start_leader(pods: list[_Pod], args: ServeArgs, tmp_path: Path) -> _Pod:
    pod = _Pod(
        dataclasses.replace(args, node_rank=0),
        host=LEADER_HOST,
        termination_log=tmp_path / "leader-termination-log",
        env={ENV_GROUP_SIZE: "2"},
    )
    pods.append(pod)
    return pod


def _wait_ready(*group: _Pod) -> None:
    for pod in group:
        wait_until(lambda pod=pod: pod.status("/ready") == 200, timeout_s=150, what=f"{pod.base} to become ready")


def test_tp2_over_two_pods_answers_like_one_process_and_a_dead_leader_ends_the_worker_pod(
    tiny_llama_dir: Path, tmp_path: Path, pods: list[_Pod], one_process_answers: list[str]
) -> None:
    args = _group_args(tiny_llama_dir, tensor_parallel_size=2)
    worker = _start_worker(pods, args, tmp_path)  # before its leader: it waits
    wait_until(lambda: worker.status("/health") == 200, timeout_s=60, what="the worker pod's /health")
    assert worker.status("/ready") == 503
    leader = _start_leader(pods, args, tmp_path)
    _wait_ready(leader, worker)

    assert _answers(leader.base) == one_process_answers
    assert len(set(one_process_answers)) > 1
    assert worker.status("/health") == 200
    assert worker.status("/v1/models") == 404  # the API is the leader's
    assert len(worker.children()) == 1 and not leader.children()  # one rank per pod

    time.sleep(2.5)  # idle past a keepalive ping (2 s): the group stays up
    assert leader.status("/ready") == 200 and worker.status("/ready") == 200
    leader.proc.send_signal(signal.SIGKILL)
    code, took = worker.exit_code_within(EXIT_WITHIN_S)
    assert code == WORKER_EXIT_STATUS, worker.output()
    assert took < EXIT_WITHIN_S
    message = worker.termination_log.read_text()
    assert message.startswith("node 1 (rank 1): "), message
    assert "leader" in message


def test_pp2_over_two_pods_answers_like_one_process_and_a_dead_worker_rank_ends_both_pods(
    tiny_llama_dir: Path, tmp_path: Path, pods: list[_Pod], one_process_answers: list[str]
) -> None:
    args = _group_args(tiny_llama_dir, pipeline_parallel_size=2)
    leader = _start_leader(pods, args, tmp_path)
    worker = _start_worker(pods, args, tmp_path)
    _wait_ready(leader, worker)

    assert _answers(leader.base) == one_process_answers
    (rank,) = worker.children()
    subprocess.run(["kill", "-9", str(rank)], check=True)
    cause = "node 1 (rank 1): parallel rank 1 exited with status -9"
    for pod in (worker, leader):  # the worker pod reports the cause in the store, the leader reads it
        code, took = pod.exit_code_within(EXIT_WITHIN_S)
        assert code == WORKER_EXIT_STATUS, pod.output()
        assert took < EXIT_WITHIN_S
        assert cause in pod.termination_log.read_text()
