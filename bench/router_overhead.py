"""The router's added latency and CPU per request, side by side with direct calls and nginx
(issue 17, "Router"), in one run.

Three paths lead to the same upstream pod: **direct**; through **nginx** (Debian ``nginx-light``
as a plain ``proxy_pass`` reverse proxy: ``proxy_buffering off`` so streams pass through,
HTTP/1.1 keep-alive to the pod); and through our **router** (the real ``splitserve router``
process, static discovery, the pod as its only aggregated pod). ``--variant NAME=DIR`` adds a
path through another router process with ``DIR`` first on its ``PYTHONPATH``: another copy of
``splitserve_runtime`` for a before/after in one run (``git archive HEAD runtime | tar -x -C
/tmp/base``, then ``--variant before=/tmp/base/runtime``), or extra packages (``pip install
--target DIR httptools uvloop``, which uvicorn picks up on its own). Requests go out open loop
at a fixed rate per path, interleaved evenly (path 0, 1, 2, 0, ...), so machine noise hits every
path alike. Per path: p50/p99 latency
(streams: time to the first event and to the end), added latency = path − direct at the same
percentile, and the proxy process's CPU seconds per request (``utime + stime`` of
``/proc/<pid>/stat``, nginx master and worker, before and after each phase; the router's figure
includes its health poller, a few requests a second; the clock ticks are 10 ms, so a phase's
figure is good to 10 ms ÷ its requests, and a proxy using less reads 0).

The upstream. The default is a **stand-in** pod (:class:`StandInPod`, a raw asyncio HTTP/1.1
server in its own process): it answers ``/ready``, the info and ``/metrics`` paths the router
polls, a fixed completion body, and a fixed SSE stream whose length and pacing the request
sets (``max_tokens`` events, ``bench_chunk_interval_ms`` apart). Its answer costs tens of µs
with little spread, so a difference under 1 ms between paths is the proxy's; the real runtime
server on this 2-core machine spends milliseconds per request in its engine loop with a spread
that buries the proxy's share. ``--upstream runtime`` (or ``both``) measures against the real
``splitserve serve`` too (tiny random model, CPU, at the lower ``--runtime-rates``).

Open streams: an LLM router holds many streams at once, so one more phase sends plain requests
while ``--open-streams`` slow streams (an event every 2 s) stay open through each path; the
proxy's CPU per request then includes relaying those events (100 a second for 200 streams).

Pass-through: a few streams of events 25 ms apart go through each path one at a time; a proxy
that re-buffered would deliver the first event only with the last. Reported per path: the
first event's arrival time against the stream's end (``incremental``) and the median gap
between events (≈ the upstream's 25 ms when nothing is held back).

    python bench/router_overhead.py [--quick] [--json] [--rates 50,200] [--seconds 4]
        [--upstream stand-in|runtime|both] [--runtime-rates 10,30] [--open-streams 200]
        [--variant NAME=DIR ...]

Without nginx the nginx path is reported as not installed; as root the bench installs
``nginx-light`` with apt-get when ``--install-nginx`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
MODEL = "bench"
START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 10.0
IDLE_REUSE_S = 3.0
STREAM_EVENTS = 16
PASS_THROUGH_EVENTS = 8
PASS_THROUGH_INTERVAL_MS = 25.0
PASS_THROUGH_STREAMS = 3
OPEN_STREAM_INTERVAL_MS = 2000.0
NGINX_NOT_INSTALLED = "not installed"


# ---------------------------------------------------------------------------- stand-in upstream
_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": " hello from the stand-in pod", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14},
    }
).encode()
_EVENT = (
    b"data: "
    + json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}],
        }
    ).encode()
    + b"\n\n"
)
_DONE = b"data: [DONE]\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _fixed_response(status: str, content_type: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


_GET_ANSWERS = {
    b"/ready": _fixed_response("200 OK", "application/json", b'{"status":"ready"}'),
    b"/health": _fixed_response("200 OK", "application/json", b'{"status":"ok"}'),
    b"/v1/splitserve/info": _fixed_response("200 OK", "application/json", b'{"compat_hash":"bench","kv_endpoint":""}'),
    b"/metrics": _fixed_response("200 OK", "text/plain; version=0.0.4", b""),
    b"/v1/models": _fixed_response(
        "200 OK",
        "application/json",
        json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode(),
    ),
}
_NOT_FOUND = _fixed_response("404 Not Found", "application/json", b'{"error":"not found"}')
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class StandInPod(asyncio.Protocol):
    """One keep-alive connection of the stand-in pod: requests with a Content-Length body
    (what httpx and nginx send), one at a time."""

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._next()

    def _next(self) -> None:
        while not self._busy and self._transport is not None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end].split(b"\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            method, target, _version = head[0].split(b" ", 2)
            self._answer(method, target, body)

    def _answer(self, method: bytes, target: bytes, body: bytes) -> None:
        assert self._transport is not None
        if method == b"GET":
            self._transport.write(_GET_ANSWERS.get(target, _NOT_FOUND))
            return
        if target not in (b"/v1/completions", b"/v1/chat/completions"):
            self._transport.write(_NOT_FOUND)
            return
        request = json.loads(body)
        if not request.get("stream"):
            self._transport.write(_fixed_response("200 OK", "application/json", _COMPLETION))
            return
        self._busy = True
        events = int(request.get("max_tokens") or STREAM_EVENTS)
        interval_s = float(request.get("bench_chunk_interval_ms") or 0.0) / 1000
        asyncio.get_running_loop().create_task(self._stream(events, interval_s))

    async def _stream(self, events: int, interval_s: float) -> None:
        transport = self._transport
        assert transport is not None
        transport.write(_STREAM_HEAD)
        for i in range(events):
            if interval_s and i:
                await asyncio.sleep(interval_s)
            if transport.is_closing():
                return
            transport.write(_chunk(_EVENT))  # one write per event: one send(2) each
        transport.write(_chunk(_DONE) + b"0\r\n\r\n")
        self._busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


async def _serve_stand_in(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(StandInPod, HOST, port, backlog=1024)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------- client
@dataclasses.dataclass
class Reply:
    status: int
    started: float
    first_event: float | None
    ended: float
    event_times: list[float]


class Connection:
    """One keep-alive HTTP/1.1 client connection; timestamps each SSE event as it arrives."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.reusable = True

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(HOST, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    def close(self) -> None:
        self.reusable = False
        self._writer.close()

    async def exchange(self, request: bytes, started: float) -> Reply:
        self._writer.write(request)
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        events: list[float] = []
        pending = b""

        def feed(data: bytes) -> None:
            nonlocal pending
            now = time.perf_counter()
            pending += data
            while (cut := pending.find(b"\n\n")) >= 0:
                events.append(now)
                pending = pending[cut + 2 :]

        if b"content-length" in headers:
            feed(await self._reader.readexactly(int(headers[b"content-length"])))
        elif headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await self._reader.readexactly(size + 2)
                if size == 0:
                    break
                feed(data[:-2])
        else:
            feed(await self._reader.read())
            self.reusable = False
        if headers.get(b"connection") == b"close":
            self.reusable = False
        return Reply(
            status=status,
            started=started,
            first_event=events[0] if events else None,
            ended=time.perf_counter(),
            event_times=events,
        )


class Pool:
    """Keep-alive connections to one path; a new one opens when all are busy (open loop). A
    connection idle for ``IDLE_REUSE_S`` is dropped rather than reused: uvicorn closes idle
    ones after 5 s, and a request written just then would fail through no fault of the proxy."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._idle: list[tuple[float, Connection]] = []

    async def _acquire(self) -> Connection:
        while self._idle:
            since, conn = self._idle.pop()
            if time.monotonic() - since < IDLE_REUSE_S:
                return conn
            conn.close()
        return await Connection.open(self.port)

    async def exchange(self, request: bytes, *, timeout: float | None = REQUEST_TIMEOUT_S) -> Reply:
        started = time.perf_counter()
        conn = await self._acquire()
        try:
            reply = await asyncio.wait_for(conn.exchange(request, started), timeout)
        except BaseException:
            conn.close()
            raise
        if conn.reusable:
            self._idle.append((time.monotonic(), conn))
        else:
            conn.close()
        return reply

    def close(self) -> None:
        for _, conn in self._idle:
            conn.close()
        self._idle.clear()


def _request(port: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: {HOST}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of ``pids`` (all their threads), in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


@dataclasses.dataclass
class Proc:
    """A process the bench started; killed (by its own pid) on exit."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
            )

    @property
    def pids(self) -> list[int]:
        assert self.popen is not None
        return [self.popen.pid, *_children(self.popen.pid)]

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


async def _get_status(port: int, path: str) -> int:
    try:
        conn = await asyncio.wait_for(Connection.open(port), 2)
    except (OSError, TimeoutError):
        return 0
    try:
        request = f"GET {path} HTTP/1.1\r\nhost: {HOST}:{port}\r\n\r\n".encode()
        return (await asyncio.wait_for(conn.exchange(request, time.perf_counter()), 5)).status
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return 0
    finally:
        conn.close()


async def _wait_ready(proc: Proc, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while await _get_status(port, "/ready") != 200:
        assert proc.popen is not None
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not become ready:\n{proc.log_tail()}")
        await asyncio.sleep(0.1)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )


def install_nginx() -> str | None:
    """``apt-get install nginx-light`` when root and nginx is missing; the binary or None."""
    if nginx_binary() is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx-light"],
            env=env,
            check=False,
            stdout=subprocess.DEVNULL,
        )
    return nginx_binary()


def nginx_conf(*, work: Path, listen_port: int, upstream_port: int) -> str:
    """A plain reverse proxy: keep-alive HTTP/1.1 to the pod, no response buffering."""
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "\n".join(
        f"  {kind}_temp_path {work}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""{user}worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
{temp}
  upstream pod {{ server {HOST}:{upstream_port}; keepalive 64; }}
  server {{
    listen {HOST}:{listen_port} backlog=1024;
    location / {{
      proxy_pass http://pod;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


@dataclasses.dataclass
class Path_:
    """One way to the upstream: its client pool and the proxy processes (none: direct)."""

    name: str
    pool: Pool
    proc: Proc | None = None

    def cpu(self) -> float | None:
        return None if self.proc is None else cpu_seconds(self.proc.pids)


def _router_proc(*, work: Path, name: str, port: int, upstream_port: int, src: Path | None) -> Proc:
    argv = [
        sys.executable,
        "-m",
        "splitserve_cli",
        "router",
        "--host",
        HOST,
        "--port",
        str(port),
        "--discovery",
        "static",
        "--aggregated-endpoints",
        f"{HOST}:{upstream_port}",
        "--served-model-name",
        MODEL,
        "--health-interval-seconds",
        "1",
    ]
    env = {}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
    return Proc(name=name, argv=argv, log_path=work / f"{name}.log", env=env)


# ---------------------------------------------------------------------------- measuring
@dataclasses.dataclass
class Workload:
    """What one upstream is asked: the request body for streaming or not."""

    upstream: str
    stream_body: dict[str, Any]
    plain_body: dict[str, Any]


def stand_in_workload() -> Workload:
    base = {"model": MODEL, "prompt": "Say hello to the router benchmark.", "temperature": 0}
    return Workload(
        upstream="stand-in",
        plain_body={**base, "max_tokens": 6},
        stream_body={**base, "max_tokens": STREAM_EVENTS, "stream": True},
    )


def runtime_workload() -> Workload:
    base = {
        "model": MODEL,
        "prompt": "Say hello to the router benchmark.",
        "temperature": 0,
        "max_tokens": 4,
        "ignore_eos": True,
    }
    return Workload(upstream="runtime", plain_body=base, stream_body={**base, "stream": True})


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def run_phase(
    paths: Sequence[Path_], *, rate: float, seconds: float, body: dict[str, Any], stream: bool
) -> dict[str, dict[str, Any]]:
    """``rate`` requests/s to each path for ``seconds``, open loop, evenly interleaved."""
    per_path = max(1, round(rate * seconds))
    total = per_path * len(paths)
    interval = 1 / (rate * len(paths))
    requests = {p.name: _request(p.pool.port, body) for p in paths}
    cpu_before = {p.name: p.cpu() for p in paths}
    loop = asyncio.get_running_loop()
    tasks: list[tuple[str, asyncio.Task[Reply]]] = []
    start = loop.time() + 0.02
    for i in range(total):
        path = paths[i % len(paths)]
        delay = start + i * interval - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append((path.name, loop.create_task(path.pool.exchange(requests[path.name]))))
    await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
    results: dict[str, dict[str, Any]] = {}
    for path in paths:
        replies: list[Reply] = []
        errors: Counter[str] = Counter()
        for name, task in tasks:
            if name != path.name:
                continue
            exc = task.exception()
            reply = None if exc else task.result()
            if reply is None:
                errors[type(exc).__name__] += 1
            elif reply.status != 200:
                errors[f"HTTP {reply.status}"] += 1
            elif stream and reply.first_event is None:
                errors["stream without events"] += 1
            else:
                replies.append(reply)
        after, before = path.cpu(), cpu_before[path.name]
        row: dict[str, Any] = {
            "requests": len(replies),
            "errors": sum(errors.values()),
            "error_kinds": dict(errors),
            "cpu_ms_per_request": (
                None
                if after is None or before is None or not replies
                else round((after - before) * 1000 / len(replies), 3)
            ),
        }
        if replies:
            total_s = [r.ended - r.started for r in replies]
            row |= {"p50_ms": _ms(percentile(total_s, 50)), "p99_ms": _ms(percentile(total_s, 99))}
            if stream:
                first = [r.first_event - r.started for r in replies if r.first_event is not None]
                row |= {
                    "first_event_p50_ms": _ms(percentile(first, 50)),
                    "first_event_p99_ms": _ms(percentile(first, 99)),
                }
        results[path.name] = row
    direct = results.get("direct", {})
    for row in results.values():
        for key in ("p50_ms", "p99_ms", "first_event_p50_ms", "first_event_p99_ms"):
            if key in row and key in direct:
                row[f"added_{key}"] = round(row[key] - direct[key], 3)
    return results


async def with_open_streams(
    paths: Sequence[Path_], *, count: int, rate: float, seconds: float, body: dict[str, Any], settle_s: float
) -> dict[str, dict[str, Any]]:
    """:func:`run_phase` (plain) while ``count`` slow streams are open through each path."""
    slow = {
        **stand_in_workload().stream_body,
        "max_tokens": 1_000_000,
        "bench_chunk_interval_ms": OPEN_STREAM_INTERVAL_MS,
    }
    held: list[tuple[str, asyncio.Task[Reply]]] = []
    loop = asyncio.get_running_loop()
    for path in paths:
        for _ in range(count):
            pool = Pool(path.pool.port)
            held.append((path.name, loop.create_task(pool.exchange(_request(pool.port, slow), timeout=None))))
    await asyncio.sleep(settle_s)  # every stream connected through its proxy
    try:
        results = await run_phase(paths, rate=rate, seconds=seconds, body=body, stream=False)
        for name, row in results.items():
            row["open_streams"] = sum(1 for n, task in held if n == name and not task.done())
        return results
    finally:
        for _, task in held:
            task.cancel()
        await asyncio.gather(*(task for _, task in held), return_exceptions=True)


async def pass_through(paths: Sequence[Path_]) -> dict[str, dict[str, Any]]:
    """Streams of events ``PASS_THROUGH_INTERVAL_MS`` apart, one path at a time."""
    body = {
        **stand_in_workload().stream_body,
        "max_tokens": PASS_THROUGH_EVENTS,
        "bench_chunk_interval_ms": PASS_THROUGH_INTERVAL_MS,
    }
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        gaps: list[float] = []
        firsts: list[float] = []
        incremental = True
        events = 0
        for _ in range(PASS_THROUGH_STREAMS):
            reply = await path.pool.exchange(_request(path.pool.port, body))
            times = reply.event_times
            events = len(times)
            if reply.status != 200 or not times:
                incremental = False
                continue
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
            firsts.append(times[0] - reply.started)
            # the last event left the pod (PASS_THROUGH_EVENTS - 1) intervals after the first:
            # a proxy that held the stream back delivers the first event only then
            incremental &= times[0] - reply.started < (times[-1] - reply.started) / 2
        out[path.name] = {
            "events_per_stream": events,
            "incremental": incremental,
            "first_event_p50_ms": _ms(percentile(firsts, 50)) if firsts else None,
            "gap_p50_ms": _ms(percentile(gaps, 50)) if gaps else None,
            "gap_min_ms": _ms(min(gaps)) if gaps else None,
        }
    return out


@dataclasses.dataclass
class Options:
    rates: list[float]
    runtime_rates: list[float]
    seconds: float
    warmup_seconds: float
    upstreams: list[str]
    open_streams: int
    open_streams_settle_s: float
    variants: dict[str, Path]
    install_nginx: bool


@contextlib.contextmanager
def _processes(procs: list[Proc]) -> Iterator[None]:
    try:
        for proc in procs:
            proc.start()
        yield
    finally:
        for proc in reversed(procs):
            proc.stop()


def _upstream_proc(kind: str, *, work: Path, port: int) -> Proc:
    if kind == "stand-in":
        return Proc(
            name="stand-in-pod",
            log_path=work / "stand-in-pod.log",
            argv=[sys.executable, str(Path(__file__).resolve()), "--serve-stand-in", str(port)],
        )
    from splitserve_contract import ServeArgs, serve_argv
    from splitserve_runtime.model.tiny import write_tiny_model

    model_dir = write_tiny_model(out_dir=work / "tiny-llama", arch="llama", seed=0)
    args = ServeArgs(
        model=str(model_dir),
        served_model_name=MODEL,
        host=HOST,
        port=port,
        device="cpu",
        attention_backend="torch",
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    return Proc(
        name="runtime-pod",
        log_path=work / "runtime-pod.log",
        argv=[sys.executable, "-m", "splitserve_cli", "serve", *serve_argv(args)],
    )


async def measure_upstream(kind: str, options: Options, *, nginx: str | None) -> dict[str, Any]:
    """Every phase of one upstream: both modes at each rate, then the pass-through check."""
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        work = Path(tmp)
        upstream_port = free_port()
        upstream = _upstream_proc(kind, work=work, port=upstream_port)
        with _processes([upstream]):
            await _wait_ready(upstream, upstream_port)
            paths = [Path_("direct", Pool(upstream_port))]
            procs: list[tuple[Proc, int]] = []
            if nginx is not None:
                port = free_port()
                (work / "nginx.conf").write_text(nginx_conf(work=work, listen_port=port, upstream_port=upstream_port))
                proc = Proc(
                    name="nginx",
                    log_path=work / "nginx.log",
                    argv=[nginx, "-p", str(work), "-e", str(work / "error.log"), "-c", str(work / "nginx.conf")],
                )
                procs.append((proc, port))
            sources: list[tuple[str, Path | None]] = [("router", None)]
            sources += [(f"router@{name}", src) for name, src in options.variants.items()]
            for name, src in sources:
                port = free_port()
                procs.append(
                    (_router_proc(work=work, name=name, port=port, upstream_port=upstream_port, src=src), port)
                )
            with _processes([p for p, _ in procs]):
                for proc, port in procs:
                    await _wait_ready(proc, port)
                    paths.append(Path_(proc.name, Pool(port), proc))
                return await _measure_paths(kind, paths, options)


async def _measure_paths(kind: str, paths: list[Path_], options: Options) -> dict[str, Any]:
    workload = stand_in_workload() if kind == "stand-in" else runtime_workload()
    rates = options.rates if kind == "stand-in" else options.runtime_rates
    for stream, body in ((False, workload.plain_body), (True, workload.stream_body)):
        await run_phase(paths, rate=min(rates), seconds=options.warmup_seconds, body=body, stream=stream)
    phases = []
    for rate in rates:
        for stream, body in ((False, workload.plain_body), (True, workload.stream_body)):
            results = await run_phase(paths, rate=rate, seconds=options.seconds, body=body, stream=stream)
            phases.append({"rate": rate, "stream": stream, "open_streams": 0, "paths": results})
    if kind == "stand-in" and options.open_streams:
        results = await with_open_streams(
            paths,
            count=options.open_streams,
            rate=min(rates),
            seconds=options.seconds,
            body=workload.plain_body,
            settle_s=options.open_streams_settle_s,
        )
        phases.append({"rate": min(rates), "stream": False, "open_streams": options.open_streams, "paths": results})
    out: dict[str, Any] = {"phases": phases}
    if kind == "stand-in":
        out["pass_through"] = await pass_through(paths)
    for path in paths:
        path.pool.close()
    return out


def _raise_open_files_limit() -> None:
    """Open streams hold a few sockets each, in this process and the servers it starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(options: Options) -> dict[str, Any]:
    _raise_open_files_limit()
    nginx = install_nginx() if options.install_nginx else nginx_binary()
    report: dict[str, Any] = {
        "rates": options.rates,
        "runtime_rates": options.runtime_rates,
        "seconds_per_phase": options.seconds,
        "open_streams": options.open_streams,
        "nginx": nginx or NGINX_NOT_INSTALLED,
        "upstreams": {},
    }
    for kind in options.upstreams:
        report["upstreams"][kind] = await measure_upstream(kind, options, nginx=nginx)
    return report


# ---------------------------------------------------------------------------- report
def _fmt(value: Any, width: int = 7) -> str:
    if value is None:
        return "-".rjust(width)
    if isinstance(value, float):
        return f"{value:{width}.2f}"
    return str(value).rjust(width)


def _ratio(a: Any, b: Any) -> str:
    """a ÷ b; none when b is under 0.05 (ms), where the ratio says nothing."""
    if not isinstance(a, float | int) or not isinstance(b, float | int) or b < 0.05:
        return "-".rjust(6)
    return f"{a / b:6.1f}"


def format_report(report: dict[str, Any]) -> str:
    """One table: per phase and path p50/p99 (and first event), added vs direct, CPU/request;
    then router÷nginx ratios of added latency and CPU."""
    lines = [f"nginx: {report['nginx']}"]
    width = max(
        [16]
        + [len(name) for data in report["upstreams"].values() for phase in data["phases"] for name in phase["paths"]]
    )
    header = (
        f"{'upstream':9} {'rate':>5} {'mode':15} {'path':{width}} {'ok':>5} {'err':>3} "
        f"{'p50':>7} {'p99':>7} {'+p50':>7} {'+p99':>7} {'1st50':>7} {'+1st50':>7} "
        f"{'cpu/req':>7} {'r/n+50':>6} {'r/n cpu':>7}"
    )
    lines += [header + "   (ms; +: added vs direct; r/n: router ÷ nginx)", "-" * len(header)]
    for kind, data in report["upstreams"].items():
        for phase in data["phases"]:
            paths = phase["paths"]
            nginx = paths.get("nginx", {})
            mode = "stream" if phase["stream"] else "plain"
            if phase["open_streams"]:
                mode += f" +{phase['open_streams']} open"
            for name, row in paths.items():
                ratios = ("", "")
                if name.startswith("router") and nginx:
                    ratios = (
                        _ratio(row.get("added_p50_ms"), nginx.get("added_p50_ms")),
                        _ratio(row.get("cpu_ms_per_request"), nginx.get("cpu_ms_per_request")),
                    )
                lines.append(
                    f"{kind:9} {phase['rate']:5g} {mode:15} "
                    f"{name:{width}} {row['requests']:5d} {row['errors']:3d} "
                    f"{_fmt(row.get('p50_ms'))} {_fmt(row.get('p99_ms'))} "
                    f"{_fmt(row.get('added_p50_ms'))} {_fmt(row.get('added_p99_ms'))} "
                    f"{_fmt(row.get('first_event_p50_ms'))} {_fmt(row.get('added_first_event_p50_ms'))} "
                    f"{_fmt(row.get('cpu_ms_per_request'))} {ratios[0]:>6} {ratios[1]:>7}"
                    + (f"  ({row['open_streams']} still open)" if "open_streams" in row else "")
                    + (f"  errors: {row['error_kinds']}" if row["errors"] else "")
                )
        for name, check in data.get("pass_through", {}).items():
            lines.append(
                f"{kind:9} pass-through {name:{width}} events={check['events_per_stream']} "
                f"incremental={check['incremental']} first={check['first_event_p50_ms']} ms "
                f"gap p50={check['gap_p50_ms']} ms min={check['gap_min_ms']} ms "
                f"(pod: {PASS_THROUGH_INTERVAL_MS:g} ms)"
            )
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive comma-separated rates, got {text!r}")
    return values


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short phases (1 s, 0.5 s warm-up), stand-in upstream only, at most 20 open streams",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--rates",
        type=_floats,
        default=[50.0, 200.0],
        help="requests/s per path against the stand-in pod (default 50,200)",
    )
    parser.add_argument(
        "--runtime-rates",
        type=_floats,
        default=[10.0, 30.0],
        help="requests/s per path against the runtime pod (default 10,30)",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    parser.add_argument(
        "--open-streams",
        type=int,
        default=200,
        help="slow streams held open through each path in one more phase (0: none)",
    )
    parser.add_argument("--upstream", choices=("stand-in", "runtime", "both"), default="both")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="add a router path run with DIR first on PYTHONPATH (repeatable)",
    )
    parser.add_argument(
        "--install-nginx", action="store_true", help="apt-get install nginx-light when missing (root only)"
    )
    parser.add_argument("--serve-stand-in", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_stand_in:
        asyncio.run(_serve_stand_in(args.serve_stand_in))
        return 0
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    if args.open_streams < 0:
        parser.error("--open-streams must be >= 0")
    variants: dict[str, Path] = {}
    for spec in args.variant:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not Path(directory).is_dir():
            parser.error(f"--variant wants NAME=DIR with an existing DIR, got {spec!r}")
        variants[name] = Path(directory).resolve()
    quick = args.quick
    options = Options(
        rates=args.rates,
        runtime_rates=args.runtime_rates,
        seconds=1.0 if quick else args.seconds,
        warmup_seconds=0.5 if quick else 1.0,
        upstreams=(["stand-in"] if quick else ["stand-in", "runtime"] if args.upstream == "both" else [args.upstream]),
        open_streams=min(args.open_streams, 20) if quick else args.open_streams,
        open_streams_settle_s=1.0 if quick else 2.0,
        variants=variants,
        install_nginx=args.install_nginx,
    )
    report = asyncio.run(run(options))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
