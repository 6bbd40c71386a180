"""A disaggregated deployment on loopback, as real processes: `splitserve serve --role prefill`
and `--role decode` pods and a `splitserve router` with static discovery, each on its own
127.0.0.x address (as pods have their own IPs), on the tiny checkpoint on CPU.

:class:`Cluster` starts every process at once (they load in parallel), waits until each answers
``/ready``, and kills all of them on exit, also when a test fails; their logs go to files that
a failing start prints. Metric helpers read one pod's ``/metrics`` into ``{(name, labels): value}``.

As the operator does, the cluster gives its prefill and decode pods one KV handoff key (a file
passed as ``--handoff-key-file``), so the handoff is authenticated as in production;
:meth:`Cluster.sign` signs handoff parameters a test writes itself (as a prefill pod would).
``handoff_key=None`` runs the pods without a key (loopback only, the development mode).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve_contract import ServeArgs, serve_argv
from splitserve_e2e.net import free_port

MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 64
COMPAT_HASH = "tinyhash"
START_TIMEOUT_SECONDS = 120.0


def serve_args(*, model_dir: Path, **overrides: object) -> ServeArgs:
    """The pods' flags; the aggregated reference engine uses the same numerics."""
    base = ServeArgs(
        model=str(model_dir),
        served_model_name=MODEL_NAME,
        device="cpu",
        attention_backend="torch",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=512,
    )
    import dataclasses

    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def _command() -> list[str]:
    exe = shutil.which("splitserve")
    return [exe] if exe else [sys.executable, "-m", "splitserve_cli"]


@dataclass
class Proc:
    name: str
    host: str
    port: int
    argv: list[str]
    log_path: Path
    kv_port: int = 0
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        log.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.metrics().items() if n == name and wanted <= ls)


@dataclass
class Cluster:
    model_dir: Path
    log_dir: Path
    num_prefill: int = 1
    num_decode: int = 2
    policy: str = "PrefixAffinity"
    kv_ttl_seconds: float = 30.0
    health_interval_seconds: float = 0.5
    short_prompt_threshold: int = 8
    prefill_overflow_tokens: int = 0
    decode_overrides: dict[str, Any] = field(default_factory=dict)
    prefill_overrides: dict[str, Any] = field(default_factory=dict)
    handoff_key: bytes | None = field(default_factory=lambda: secrets.token_hex(32).encode())
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    router: Proc | None = None
    extra: list[Proc] = field(default_factory=list)

    def _pod(self, *, role: str, index: int, octet: int) -> Proc:
        host = f"127.0.0.{octet}"
        port, kv_port = free_port(host), free_port(host)  # never the same: free_port repeats none
        args = serve_args(
            model_dir=self.model_dir,
            role=role,
            host=host,
            port=port,
            kv_port=kv_port,
            kv_ttl_seconds=self.kv_ttl_seconds,
            compat_hash=COMPAT_HASH,
            handoff_key_file=self._key_file(),
            **(self.decode_overrides if role == "decode" else self.prefill_overrides),
        )
        return Proc(
            name=f"{role}-{index}",
            host=host,
            port=port,
            kv_port=kv_port,
            argv=[*_command(), "serve", *serve_argv(args)],
            log_path=self.log_dir / f"{role}-{index}.log",
        )

    def _key_file(self) -> str:
        if self.handoff_key is None:
            return ""
        path = self.log_dir / "handoff.key"
        if not path.exists():
            path.write_bytes(self.handoff_key + b"\n")  # a Secret's file may end in a newline
            path.chmod(0o600)
        return str(path)

    def sign(self, params: dict[str, Any], *, lifetime_seconds: float = 30.0) -> dict[str, Any]:
        """``params`` as a prefill pod of this cluster signs them (unchanged without a key)."""
        from splitserve_runtime.transfer.auth import HandoffAuth, HandoffKey

        key = HandoffKey(self.handoff_key) if self.handoff_key is not None else None
        return HandoffAuth(key=key).sign(params, lifetime_seconds=lifetime_seconds)

    def __enter__(self) -> Cluster:
        octet = 10
        for i in range(self.num_prefill):
            self.prefill.append(self._pod(role="prefill", index=i, octet=octet))
            octet += 1
        for i in range(self.num_decode):
            self.decode.append(self._pod(role="decode", index=i, octet=octet))
            octet += 1
        self.router = self.router_proc(policy=self.policy, octet=octet)
        try:
            for pod in self.pods:
                pod.start()
            self._wait(self.pods)
            self.router.start()  # after the pods: its first poll finds every pod healthy
            self._wait([self.router])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def router_proc(self, *, policy: str, octet: int) -> Proc:
        """A (not yet started) router over this cluster's pods on 127.0.0.`octet`."""
        host = f"127.0.0.{octet}"
        port = free_port(host)
        return Proc(
            name=f"router-{policy}",
            host=host,
            port=port,
            log_path=self.log_dir / f"router-{policy}.log",
            argv=[
                *_command(),
                "router",
                "--host",
                host,
                "--port",
                str(port),
                "--discovery",
                "static",
                "--prefill-endpoints",
                ",".join(p.endpoint for p in self.prefill),
                "--decode-endpoints",
                ",".join(p.endpoint for p in self.decode),
                "--policy",
                policy,
                "--model",
                str(self.model_dir),
                "--served-model-name",
                MODEL_NAME,
                "--block-size",
                str(BLOCK_SIZE),
                "--short-prompt-threshold",
                str(self.short_prompt_threshold),
                "--prefill-overflow-tokens",
                str(self.prefill_overflow_tokens),
                "--health-interval-seconds",
                str(self.health_interval_seconds),
                "--request-timeout-seconds",
                "60",
            ],
        )

    def start_router(self, proc: Proc) -> None:
        proc.start()
        self.extra.append(proc)
        self._wait([proc])

    @property
    def pods(self) -> list[Proc]:
        return [*self.prefill, *self.decode]

    def _wait(self, procs: list[Proc]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        pending = list(procs)
        while pending:
            for proc in list(pending):
                if not proc.alive():
                    raise AssertionError(f"{proc.name} exited while starting:\n{proc.log_tail()}")
                if proc.ready():
                    pending.remove(proc)
            if time.monotonic() > deadline:
                raise AssertionError("not ready in time: " + ", ".join(f"{p.name}:\n{p.log_tail()}" for p in pending))
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        for proc in [*self.extra, *(([self.router]) if self.router else []), *self.pods]:
            proc.kill()

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return f"{self.router.url}/v1"


def wait_for(predicate: Callable[[], object], *, timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_seconds} s waiting for {what}")


class Reference:
    """The aggregated engine in this process, with the pods' numerics: the expected answers."""

    def __init__(self, *, model_dir: Path, **overrides: Any) -> None:
        from splitserve_runtime.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_args(serve_args(model_dir=model_dir, **overrides))
        self._count = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompt_token_ids: list[int], *, max_tokens: int, **params: Any) -> tuple[str, list[int]]:
        """(text, token ids) of a greedy (or seeded) completion."""
        from splitserve_runtime.engine.sampling_params import SamplingParams

        self._count += 1
        request_id = f"ref-{self._count}"
        self.engine.add_request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0), **params),
        )
        text: list[str] = []
        tokens: list[int] = []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                text.append(out.new_text)
                tokens.extend(out.new_token_ids)
        return "".join(text), tokens
