"""Build (or reuse) the pinned binaries of the local control plane.

There is no kube-apiserver package and no container engine on the machines this project runs
on, so the control plane is compiled from Go modules: kube-apiserver, kube-controller-manager,
kube-scheduler and kubectl from the small module in ``e2e/gobin`` (which pins
``k8s.io/kubernetes``), kwok, helm and Prometheus with ``go install <module>@<version>``
(Debian's Prometheus lacks Kubernetes service discovery), and etcd 3.6 from
``go.etcd.io/etcd/server/v3`` (Debian's 3.4 lacks what kube-apiserver 1.34's watch cache needs).

Each tool group lives in ``~/.cache/splitserve/bin/<tool>-<version>/``. A stamp file (version
and the exact Go arguments) is written only after every output of the group is in place, so an
interrupted build is redone on the next call, a changed recipe is rebuilt, and a finished one
is reused without invoking Go at all. Go builds print nothing for
minutes, so a heartbeat line with the elapsed seconds is printed while one runs.

Run ``python -m splitserve_e2e.build`` to build everything ahead of the tests (``--node`` adds
the optional kubelet node's kubelet, kube-proxy, image binaries, its cluster DNS, CoreDNS, and its
NetworkPolicy enforcer, kube-router).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

KUBERNETES_VERSION = "v1.34.4"
# Debian's etcd 3.4.23 lacks RequestWatchProgress: kube-apiserver 1.34 then refuses the
# streaming lists (WatchList) that client-go >= 0.35 uses by default ("the required storage
# feature RequestWatchProgress is disabled") and kwok/helm/Prometheus clients loop on errors.
# etcd 3.6.4 is what Kubernetes 1.34 ships with and what its client (in gobin/go.mod) pins.
ETCD_VERSION = "v3.6.4"
ETCD_PACKAGE = "go.etcd.io/etcd/server/v3"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v4.3.2"
HELM_MODULE = "helm.sh/helm/v4/cmd/helm"
# Debian's prometheus 2.42 is built without kubernetes_sd_configs ("field kubernetes_sd_configs
# not found"), so Prometheus is built from its Go module too, with only the kubernetes (and the
# always-on file/http) service discovery compiled in. Module v0.316.0 is Prometheus 3.16.0.
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_MODULE = "github.com/prometheus/prometheus/cmd/prometheus"
PROMTOOL_MODULE = "github.com/prometheus/prometheus/cmd/promtool"
KWOK_MODULE = "sigs.k8s.io/kwok/cmd/kwok"
# The kubelet node's cluster DNS (splitserve_e2e.coredns). Built as upstream documents a custom
# build: plugin.cfg trimmed to these plugins, `go run directives_generate.go` (what its
# `go generate` runs), `go build` inside the module with its own go.mod/go.sum. Fewer plugins:
# only the kubernetes plugin's dependencies are compiled (no cloud SDKs), and it builds in
# minutes; `go install module@version` is refused by the proxy (the @v/list lookup).
COREDNS_VERSION = "v1.12.4"
COREDNS_MODULE = "github.com/coredns/coredns"
COREDNS_PLUGINS = ("bind", "ready", "health", "errors", "log", "cache", "template", "kubernetes")
# The kubelet node's NetworkPolicy enforcer (splitserve_e2e.netpol): kube-router run with only
# its network policy controller (iptables + ipset, in the FORWARD path of the bridged pod
# traffic). The SIG Network agent sigs.k8s.io/kube-network-policies was the first choice, but
# it queues packets with nftables' `queue` statement, which this kernel lacks
# (CONFIG_NFT_QUEUE unset: `nft add rule ... queue num 100` answers "No such file or directory").
KUBE_ROUTER_VERSION = "v2.1.0"
KUBE_ROUTER_MODULE = "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"


GOBIN_MODULE_DIR = Path(__file__).resolve().parent.parent / "gobin"
STAMP_NAME = ".complete.json"
HEARTBEAT_SECONDS = 20.0
_GO_BUILD_FLAGS = ("-trimpath", "-ldflags=-s -w")


def _kubernetes_ldflags() -> str:
    """Stamp the version into the binaries as Kubernetes' own build does (hack/lib/version.sh);
    without it they report v0.0.0-master and version checks (helm's kubeVersion) fail."""
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    values = {
        "gitVersion": KUBERNETES_VERSION,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "gitCommit": "splitserve-gobin",
    }
    pairs = [
        f"-X {package}.{key}={value}"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in values.items()
    ]
    return "-ldflags=-s -w " + " ".join(pairs)


class BuildError(RuntimeError):
    """A binary could not be built or found; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Absolute paths of every executable the harness runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    kwok_stages: Path  # kwok >= 0.8 has no built-in stages: the "fast" set of its release
    helm: Path
    prometheus: Path
    promtool: Path


@dataclasses.dataclass(frozen=True)
class NodeBinaries:
    """Executables of the optional real node (:mod:`splitserve_e2e.kubeletnode`)."""

    kubelet: Path
    kube_proxy: Path
    pause: Path  # static sandbox binary, packed into the pause image
    apiprobe: Path  # static in-cluster API client, packed into the test image
    coredns: Path  # the pods' cluster DNS, a host process (splitserve_e2e.coredns)
    kube_router: Path  # NetworkPolicy enforcement, a host process (splitserve_e2e.netpol)


@dataclasses.dataclass(frozen=True)
class _ToolGroup:
    """Binaries produced by one Go invocation, cached together under one directory."""

    name: str
    version: str
    binaries: tuple[str, ...]
    go_args: tuple[str, ...]
    workdir: Path | None  # None: `go install module@version` outside any module
    extra_files: tuple[str, ...] = ()
    """Non-executable outputs written by ``post_build`` (part of the completeness check)."""
    post_build: Callable[[Path, dict[str, str]], None] | None = None
    scratch_imports: tuple[str, ...] = ()
    scratch_go_get: tuple[str, ...] = ()
    """``go get`` these in the scratch module before tidying (pins a version tidy would not)."""
    """When set, build in a scratch copy of ``workdir``'s go.mod/go.sum whose tools file imports
    these packages, after ``go mod tidy`` there (the pinned module stays untouched)."""
    prepare: Callable[[dict[str, str]], Path] | None = None
    """Makes the directory Go builds in (instead of ``workdir``), e.g. a trimmed module copy."""
    inputs: tuple[str, ...] = ()
    """What ``prepare`` depends on besides the version; recorded with the recipe (a change
    rebuilds)."""


def cache_root() -> Path:
    """``$SPLITSERVE_CACHE`` or ``~/.cache/splitserve``."""
    override = os.environ.get("SPLITSERVE_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "splitserve"


KWOK_STAGES_FILE = "stages.yaml"
# the stage set kwok's docs call "fast" (kustomize/stage/fast): nodes become Ready with a Lease
# heartbeat, pods become Running/Ready at once, complete when owned by a Job, and go on delete
_KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)


def _write_kwok_stages(directory: Path, env: dict[str, str]) -> None:
    """Concatenate kwok's own stage files from the pinned module (same version as the binary)."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK_VERSION}"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise BuildError(f"go mod download sigs.k8s.io/kwok@{KWOK_VERSION} failed: {result.stderr}")
    module_dir = Path(json.loads(result.stdout)["Dir"])
    documents = [(module_dir / name).read_text().strip() for name in _KWOK_STAGE_FILES]
    (directory / KWOK_STAGES_FILE).write_text("\n---\n".join(documents) + "\n")


def _groups() -> tuple[_ToolGroup, ...]:
    k8s = "k8s.io/kubernetes/cmd/"
    return (
        _ToolGroup(
            name="etcd",
            version=ETCD_VERSION,
            binaries=("etcd",),
            go_args=("build", *_GO_BUILD_FLAGS, "-o", "{out}/etcd", ETCD_PACKAGE),
            workdir=GOBIN_MODULE_DIR,
            scratch_imports=(ETCD_PACKAGE,),
            scratch_go_get=(f"{ETCD_PACKAGE}@{ETCD_VERSION}",),
        ),
        _ToolGroup(
            name="k8s",
            version=KUBERNETES_VERSION,
            binaries=("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
            go_args=(
                "build",
                "-trimpath",
                _kubernetes_ldflags(),
                "-o",
                "{out}/",
                k8s + "kube-apiserver",
                k8s + "kube-controller-manager",
                k8s + "kube-scheduler",
            ),
            workdir=GOBIN_MODULE_DIR,
        ),
        _ToolGroup(
            name="kubectl",
            version=KUBERNETES_VERSION,
            binaries=("kubectl",),
            go_args=("build", "-trimpath", _kubernetes_ldflags(), "-o", "{out}/", k8s + "kubectl"),
            workdir=GOBIN_MODULE_DIR,
            scratch_imports=(k8s + "kubectl",),
        ),
        _ToolGroup(
            name="kwok",
            version=KWOK_VERSION,
            binaries=("kwok",),
            go_args=("install", *_GO_BUILD_FLAGS, f"{KWOK_MODULE}@{KWOK_VERSION}"),
            workdir=None,
            extra_files=(KWOK_STAGES_FILE,),
            post_build=_write_kwok_stages,
        ),
        _ToolGroup(
            name="prometheus",
            version=PROMETHEUS_VERSION,
            binaries=("prometheus",),
            go_args=(
                "install",
                *_GO_BUILD_FLAGS,
                "-tags=remove_all_sd,enable_kubernetes_sd",
                f"{PROMETHEUS_MODULE}@{PROMETHEUS_VERSION}",
            ),
            workdir=None,
        ),
        _ToolGroup(  # checks and unit-tests the chart's alerting rules; the Prometheus group's
            # flags and tags, so its packages come from the Go build cache (seconds)
            name="promtool",
            version=PROMETHEUS_VERSION,
            binaries=("promtool",),
            go_args=(
                "install",
                *_GO_BUILD_FLAGS,
                "-tags=remove_all_sd,enable_kubernetes_sd",
                f"{PROMTOOL_MODULE}@{PROMETHEUS_VERSION}",
            ),
            workdir=None,
        ),
        _ToolGroup(
            name="helm",
            version=HELM_VERSION,
            binaries=("helm",),
            go_args=(
                "install",
                "-trimpath",
                f"-ldflags=-s -w -X helm.sh/helm/v4/internal/version.version={HELM_VERSION}",
                f"{HELM_MODULE}@{HELM_VERSION}",
            ),
            workdir=None,
        ),
    )


def _node_groups() -> tuple[_ToolGroup, ...]:
    """kubelet and kube-proxy (same pinned module and version stamp as the control plane, built
    in a scratch copy of gobin/ whose tools file imports them, like kubectl) and the static
    binaries of its images (gobin/pause, gobin/apiprobe). Separate groups: only the kubelet
    node needs them, and the control plane's stamps stay as they are."""
    k8s = "k8s.io/kubernetes/cmd/"
    return (
        _ToolGroup(
            name="node",
            version=KUBERNETES_VERSION,
            binaries=("kubelet", "kube-proxy"),
            go_args=("build", "-trimpath", _kubernetes_ldflags(), "-o", "{out}/", k8s + "kubelet", k8s + "kube-proxy"),
            workdir=GOBIN_MODULE_DIR,
            scratch_imports=(k8s + "kubelet", k8s + "kube-proxy"),
        ),
        _ToolGroup(
            name="node-images",
            version="splitserve-1",
            binaries=("pause", "apiprobe"),
            # stdlib only; netgo/osusergo keep cgo out, so both link statically (for images)
            go_args=("build", *_GO_BUILD_FLAGS, "-tags=netgo,osusergo", "-o", "{out}/", "./pause", "./apiprobe"),
            workdir=GOBIN_MODULE_DIR,
        ),
        _ToolGroup(
            name="coredns",
            version=COREDNS_VERSION,
            binaries=("coredns",),
            # netgo/osusergo: no cgo, a static binary as upstream's release (CGO_ENABLED=0)
            go_args=(
                "build",
                "-trimpath",
                "-tags=netgo,osusergo",
                f"-ldflags=-s -w -X {COREDNS_MODULE}/coremain.GitCommit=splitserve",
                "-o",
                "{out}/coredns",
                ".",
            ),
            workdir=None,
            prepare=_coredns_source,
            inputs=tuple(f"plugin:{name}" for name in COREDNS_PLUGINS),
        ),
        _ToolGroup(
            name="kube-router",
            version=KUBE_ROUTER_VERSION,
            binaries=("kube-router",),
            go_args=(
                "install",
                "-trimpath",
                "-ldflags=-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version."
                f"Version={KUBE_ROUTER_VERSION}",
                f"{KUBE_ROUTER_MODULE}@{KUBE_ROUTER_VERSION}",
            ),
            workdir=None,
        ),
    )


def download_module(module: str, version: str, env: dict[str, str] | None = None) -> Path:
    """``go mod download`` one exact module version; its (read-only) directory."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"], env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        goproxy = subprocess.run(
            ["go", "env", "GOPROXY"], env=env, capture_output=True, text=True, check=False
        ).stdout.strip()
        raise BuildError(
            f"go mod download {module}@{version} failed (GOPROXY={goproxy}): {result.stderr or result.stdout}"
        )
    return Path(json.loads(result.stdout)["Dir"])


def writable_module_copy(source: Path, *, name: str) -> Path:
    """A writable copy of a downloaded module (the module cache is read-only) under
    ``gomod/<name>``, for modules that build only inside themselves (``go install mod@v``
    asks the proxy's refused ``@v/list``). Made once, published by a rename."""
    scratch = cache_root() / "gomod" / name
    if not (scratch / "go.mod").is_file():
        partial = scratch.with_name(scratch.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial)
        for path in (partial, *partial.rglob("*")):
            path.chmod(path.stat().st_mode | 0o200)
        shutil.rmtree(scratch, ignore_errors=True)
        partial.rename(scratch)
    return scratch


def _coredns_source(env: dict[str, str]) -> Path:
    """A writable copy of the CoreDNS module whose plugin.cfg keeps only
    :data:`COREDNS_PLUGINS` (upstream's order: it is the order plugins handle a query), with
    the plugin imports and directive list regenerated from it by upstream's generator."""
    scratch = cache_root() / "gomod" / f"coredns-{COREDNS_VERSION}"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(download_module(COREDNS_MODULE, COREDNS_VERSION, env), scratch)
    for path in (scratch, *scratch.rglob("*")):
        path.chmod(path.stat().st_mode | 0o200)
    config = scratch / "plugin.cfg"
    lines = [
        line
        for line in config.read_text().splitlines()
        if line and not line.startswith("#") and line.split(":", 1)[0] in COREDNS_PLUGINS
    ]
    found = {line.split(":", 1)[0] for line in lines}
    if found != set(COREDNS_PLUGINS):
        raise BuildError(f"CoreDNS {COREDNS_VERSION}'s plugin.cfg lacks {sorted(set(COREDNS_PLUGINS) - found)}")
    config.write_text("\n".join(lines) + "\n")
    _run_go(
        args=["run", "directives_generate.go"], workdir=scratch, env=env, label=f"coredns-{COREDNS_VERSION}-generate"
    )
    return scratch


def _log(message: str) -> None:
    print(f"[splitserve-e2e build] {message}", file=sys.stderr, flush=True)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created if missing) across processes: builds of
    one group, image builds and registry starts (two pytest sessions, make + pytest, a shell)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _group_dir(group: _ToolGroup) -> Path:
    return cache_root() / "bin" / f"{group.name}-{group.version}"


def _is_complete(group: _ToolGroup, directory: Path) -> bool:
    stamp = directory / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if recorded.get("version") != group.version or recorded.get("recipe") != _recipe(group):
        return False  # a changed version or build recipe (flags) means rebuild
    return all(os.access(directory / binary, os.X_OK) for binary in group.binaries) and all(
        (directory / name).is_file() for name in group.extra_files
    )


def _recipe(group: _ToolGroup) -> list[str]:
    """What the stamp records as the build recipe: the Go arguments and the prepared inputs."""
    return [*group.go_args, *group.inputs]


def _run_go(*, args: Sequence[str], workdir: Path | None, env: dict[str, str], label: str) -> None:
    go = shutil.which("go")
    if go is None:
        raise BuildError("`go` is not on PATH; install Go >= 1.24 to build the control plane")
    log_path = cache_root() / "build-logs" / f"{label}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("w") as log_file:
        process = subprocess.Popen([go, *args], cwd=workdir, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        while True:
            try:
                return_code = process.wait(timeout=HEARTBEAT_SECONDS)
                break
            except subprocess.TimeoutExpired:
                _log(f"  {label}: still building, {time.monotonic() - started:.0f}s elapsed")
    if return_code != 0:
        tail = log_path.read_text()[-4000:]
        raise BuildError(f"`go {' '.join(args)}` failed with exit code {return_code} (log {log_path}):\n{tail}")


def _scratch_module(*, source: Path, imports: Sequence[str], name: str) -> Path:
    scratch = cache_root() / "gomod" / name
    scratch.mkdir(parents=True, exist_ok=True)
    for file_name in ("go.mod", "go.sum"):
        shutil.copyfile(source / file_name, scratch / file_name)
    lines = "\n".join(f'\t_ "{package}"' for package in imports)
    (scratch / "tools.go").write_text(f"//go:build tools\n\npackage gobin\n\nimport (\n{lines}\n)\n")
    return scratch


def _ensure_group(group: _ToolGroup) -> tuple[Path, float]:
    """Return the group's directory and the seconds spent building (0.0 when reused)."""
    directory = _group_dir(group)
    if _is_complete(group, directory):
        return directory, 0.0
    with exclusive(directory.with_name(directory.name + ".lock")):
        if _is_complete(group, directory):  # another process finished it while we waited
            return directory, 0.0
        directory.mkdir(parents=True, exist_ok=True)
        _log(
            f"building {group.name} {group.version} into {directory} (Go builds are quiet; "
            "a cold Kubernetes build takes many minutes on 2 cores)"
        )
        env = dict(os.environ)
        env["GOBIN"] = str(directory)
        env.setdefault("GOFLAGS", "-buildvcs=false")
        args = [arg.replace("{out}", str(directory)) for arg in group.go_args]
        started = time.monotonic()
        workdir = group.workdir
        label = f"{group.name}-{group.version}"
        if group.prepare is not None:
            workdir = group.prepare(env)
        elif group.scratch_imports and workdir is not None:
            workdir = _scratch_module(source=workdir, imports=group.scratch_imports, name=label)
            for module in group.scratch_go_get:
                _run_go(args=["get", module], workdir=workdir, env=env, label=f"{label}-get")
            _run_go(args=["mod", "tidy"], workdir=workdir, env=env, label=f"{label}-tidy")
        _run_go(args=args, workdir=workdir, env=env, label=label)
        elapsed = time.monotonic() - started
        if group.post_build is not None:
            group.post_build(directory, env)
        missing = [b for b in group.binaries if not os.access(directory / b, os.X_OK)]
        missing += [name for name in group.extra_files if not (directory / name).is_file()]
        if missing:
            raise BuildError(f"go finished but {missing} are missing in {directory}")
        (directory / STAMP_NAME).write_text(
            json.dumps(
                {
                    "version": group.version,
                    "recipe": _recipe(group),
                    "binaries": list(group.binaries),
                    "build_seconds": round(elapsed, 1),
                    "built_at": time.time(),
                }
            )
        )
        _log(f"built {group.name} {group.version} in {elapsed:.0f}s")
        return directory, elapsed


def ensure_binaries() -> Binaries:
    """Build missing tool groups (idempotent) and return the paths of every binary."""
    directories = {group.name: _ensure_group(group)[0] for group in _groups()}
    return Binaries(
        etcd=directories["etcd"] / "etcd",
        kube_apiserver=directories["k8s"] / "kube-apiserver",
        kube_controller_manager=directories["k8s"] / "kube-controller-manager",
        kube_scheduler=directories["k8s"] / "kube-scheduler",
        kubectl=directories["kubectl"] / "kubectl",
        kwok=directories["kwok"] / "kwok",
        kwok_stages=directories["kwok"] / KWOK_STAGES_FILE,
        helm=directories["helm"] / "helm",
        prometheus=directories["prometheus"] / "prometheus",
        promtool=directories["promtool"] / "promtool",
    )


def ensure_node_binaries() -> NodeBinaries:
    """Build (idempotent) and return the kubelet node's binaries."""
    directories = {group.name: _ensure_group(group)[0] for group in _node_groups()}
    return NodeBinaries(
        kubelet=directories["node"] / "kubelet",
        kube_proxy=directories["node"] / "kube-proxy",
        pause=directories["node-images"] / "pause",
        apiprobe=directories["node-images"] / "apiprobe",
        coredns=directories["coredns"] / "coredns",
        kube_router=directories["kube-router"] / "kube-router",
    )


def recorded_build_seconds() -> dict[str, float]:
    """Build durations recorded in the stamps (for reports); groups not built are absent."""
    seconds: dict[str, float] = {}
    for group in (*_groups(), *_node_groups()):
        stamp = _group_dir(group) / STAMP_NAME
        if stamp.is_file():
            seconds[f"{group.name}-{group.version}"] = float(json.loads(stamp.read_text()).get("build_seconds", 0.0))
    return seconds


def main() -> int:
    started = time.monotonic()
    try:
        binaries = ensure_binaries()
    except BuildError as error:
        _log(f"FAILED: {error}")
        return 1
    for field in dataclasses.fields(binaries):
        print(f"{field.name:24} {getattr(binaries, field.name)}")
    if "--node" in sys.argv[1:]:
        try:
            node_binaries = ensure_node_binaries()
        except BuildError as error:
            _log(f"FAILED: {error}")
            return 1
        for field in dataclasses.fields(node_binaries):
            print(f"{field.name:24} {getattr(node_binaries, field.name)}")
    for name, seconds in recorded_build_seconds().items():
        print(f"build time {name:24} {seconds:.0f}s")
    print(f"ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
