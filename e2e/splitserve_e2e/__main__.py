"""``python -m splitserve_e2e up|down|status`` (``make cluster-up`` / ``cluster-down``).

``up`` starts a detached daemon that owns the cluster (its processes, and the kubelet node's
host changes, which ``stop`` undoes), waits until the cluster is ready, prints how to use it and returns.
``down`` asks the daemon to stop (SIGTERM), then kills anything still recorded in the state
directory's pid files, so nothing survives even a daemon that was SIGKILLed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from splitserve_e2e.cluster import ClusterOptions, LocalCluster, default_state_dir, read_info
from splitserve_e2e.process import is_alive, kill_recorded, process_start_ticks

DAEMON_PID_DIR = "daemon"
READY_TIMEOUT_SECONDS = 900.0  # a cold build of the binaries happens inside `up`


def _options_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-gpu-nodes", type=int, default=2, help="kwok GPU nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-product", default="NVIDIA-H200")
    parser.add_argument(
        "--node-gpus", type=int, default=4, help="nvidia.com/gpu the kubelet node advertises (pods run on CPU)"
    )
    parser.add_argument("--no-prometheus", action="store_true")
    parser.add_argument(
        "--no-kubelet-node", action="store_true", help="control plane and kwok nodes only (no root needed)"
    )
    parser.add_argument("--scrape-interval-seconds", type=float, default=2.0)


def _options_argv(args: argparse.Namespace) -> list[str]:
    """The cluster options of ``up`` rendered back as flags for the daemon."""
    argv = [
        f"--num-gpu-nodes={args.num_gpu_nodes}",
        f"--gpus-per-node={args.gpus_per_node}",
        f"--gpu-product={args.gpu_product}",
        f"--node-gpus={args.node_gpus}",
        f"--scrape-interval-seconds={args.scrape_interval_seconds}",
    ]
    argv += ["--no-prometheus"] if args.no_prometheus else []
    return argv + (["--no-kubelet-node"] if args.no_kubelet_node else [])


def _options(args: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions(
        num_gpu_nodes=args.num_gpu_nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_product=args.gpu_product,
        kubelet_node_gpus=args.node_gpus,
        with_prometheus=not args.no_prometheus,
        with_kubelet_node=not args.no_kubelet_node,
        scrape_interval_seconds=args.scrape_interval_seconds,
    )


def _daemon_running(state_dir: Path) -> int | None:
    pid_file = state_dir / DAEMON_PID_DIR / "daemon.pid"
    try:
        pid = int(json.loads(pid_file.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None
    return pid if is_alive(pid) else None


def _up(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    if _daemon_running(state_dir) is not None:
        print(f"a cluster is already running in {state_dir}; `down` first", file=sys.stderr)
        return 1
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "cluster.json").unlink(missing_ok=True)
    log_path = state_dir / "daemon.log"
    argv = [sys.executable, "-m", "splitserve_e2e", "--state-dir", str(state_dir), "_serve", *_options_argv(args)]
    started = time.monotonic()
    with log_path.open("ab") as log_file:
        daemon = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    (state_dir / DAEMON_PID_DIR).mkdir(exist_ok=True)
    (state_dir / DAEMON_PID_DIR / "daemon.pid").write_text(
        json.dumps({"pid": daemon.pid, "start_ticks": process_start_ticks(daemon.pid), "name": "daemon"})
    )
    print(f"starting the local cluster (log {log_path}) ...", flush=True)
    while daemon.poll() is None:
        try:
            info = read_info(state_dir=state_dir)
            break
        except FileNotFoundError:
            pass
        if time.monotonic() - started > READY_TIMEOUT_SECONDS:
            _down_dir(state_dir)
            print(f"cluster not ready after {READY_TIMEOUT_SECONDS:.0f}s; see {log_path}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    else:
        print(
            f"the cluster daemon exited with code {daemon.returncode}; last log lines:\n"
            + log_path.read_text(errors="replace")[-3000:],
            file=sys.stderr,
        )
        return 1
    print(f"cluster ready in {time.monotonic() - started:.1f}s")
    print(f"kubeconfig:     {info['kubeconfig']}")
    print(f"api server:     {info['api_server_url']}")
    print(f"prometheus:     {info['prometheus_url']}")
    print(f"gpu nodes:      {', '.join(info['gpu_nodes']) or '-'}")
    print(f"kubelet node:   {info.get('kubelet_node') or '-'} (pods {info.get('pod_network') or '-'})")
    print(f"export KUBECONFIG={info['kubeconfig']}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The daemon: run the cluster until SIGTERM/SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    cluster = LocalCluster(state_dir=args.state_dir, options=_options(args))
    try:
        cluster.start()
        print(f"cluster up in {cluster.start_seconds:.1f}s", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        cluster.stop()
        print("cluster stopped", flush=True)
    return 0


def _down_dir(state_dir: Path) -> list[str]:
    ended = kill_recorded(pid_dir=state_dir / DAEMON_PID_DIR, grace_seconds=30.0)
    ended += kill_recorded(pid_dir=state_dir / "pids", grace_seconds=5.0)
    (state_dir / "cluster.json").unlink(missing_ok=True)
    return ended


def _down(args: argparse.Namespace) -> int:
    ended = _down_dir(args.state_dir)
    print(f"stopped: {', '.join(ended)}" if ended else "nothing was running")
    return 0


def _status(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    daemon = _daemon_running(state_dir)
    try:
        info = read_info(state_dir=state_dir)
    except FileNotFoundError as error:
        print(f"not running: {error}")
        return 1
    print(f"daemon pid:     {daemon if daemon else 'not running'}")
    print(f"kubeconfig:     {info['kubeconfig']}")
    print(f"prometheus:     {info['prometheus_url']}")
    cluster = LocalCluster.from_existing(kubeconfig=Path(info["kubeconfig"]))
    result = cluster.kubectl("get", "nodes", check=False)
    print(result.stdout or result.stderr)
    return 0 if daemon and result.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve_e2e", description="local Kubernetes control plane for splitserve"
    )
    parser.add_argument(
        "--state-dir", type=Path, default=default_state_dir(), help="where logs, pid files, certificates and data live"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _options_parser(commands.add_parser("up", help="start a detached cluster"))
    commands.add_parser("down", help="stop it and everything it started")
    commands.add_parser("status", help="is it running, and its nodes")
    _options_parser(commands.add_parser("_serve", help=argparse.SUPPRESS))
    args = parser.parse_args(argv)
    args.state_dir = args.state_dir.resolve()
    handlers = {"up": _up, "down": _down, "status": _status, "_serve": _serve}
    os.environ.pop("KUBECONFIG", None)  # never act on the user's own cluster by accident
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
