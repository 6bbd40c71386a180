"""The Gateway API Inference Extension (GIE) pieces of the e2e harness, built from its Go module.

splitserve can sit behind a gateway that implements the GIE: an ``InferencePool`` selects the
model-server pods and names an Endpoint Picker (EPP), which the gateway asks over Envoy's
ext_proc gRPC protocol which pod a request should go to; the picker scrapes the pods' vLLM-named
gauges to choose. To prove that against the product on the local cluster, without network
access to any image registry, everything comes from the pinned module
``sigs.k8s.io/gateway-api-inference-extension@v1.2.0`` (``go mod download`` of an exact version
works through the module proxy; ``go install module@version`` does not, because it asks the
proxy for the module's version list, which it refuses with 403):

* :func:`ensure_gie_crds`: the CRD manifests of ``config/crd/bases`` (InferencePool v1 and the
  x-k8s.io alpha kinds, InferenceObjective among them, which the picker also watches);
* :func:`ensure_epp`: the picker, ``cmd/epp``, built as upstream's Dockerfile builds it
  (``CGO_ENABLED=0 go build ./cmd/epp`` inside the module, with its own go.mod and go.sum, so the
  dependency versions are exactly the release's), in a writable scratch copy of the module;
  in the same step the module's CEL validation test binary (``test/cel``), which runs against
  any cluster given ``KUBECONFIG``;
* :func:`ensure_gie_client`: ``e2e/gie_client``, a small ext_proc client playing the gateway's
  part once (headers, then the JSON body), so a test can ask the picker where a request goes.

Each is cached like the control plane's binaries (:mod:`splitserve_e2e.build`): a directory
under ``~/.cache/splitserve/bin/`` with a stamp written last, rebuilt when the recipe (or, for
the client, its sources) changes, built under a cross-process lock, with a heartbeat while Go
is quiet. ``python -m splitserve_e2e.gie`` builds all three (quick when cached).

The upstream picker image (registry.k8s.io) cannot be pulled here. :func:`ensure_epp_image`
packs the built picker into a one-file OCI image (as upstream's distroless one: ``/epp``, user
65532) and pushes it to the loopback registry, so an operator-rendered picker Deployment runs
on the kubelet node with that image; :func:`start_epp` runs the binary as a host process
instead (any flags, e.g. a higher log level). :func:`pick` asks a picker for an endpoint through
the client; :meth:`EndpointPicker.metrics` reads the picker's own Prometheus metrics (what it
scraped from the pods).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .build import (
    STAMP_NAME,
    BuildError,
    _is_complete,
    _log,
    _run_go,
    _ToolGroup,
    cache_root,
    download_module,
    exclusive,
    writable_module_copy,
)
from .image import ensure_registry
from .net import LOOPBACK, free_port, port_open
from .ociimage import ImageFile, ImageSpec, write_oci_archive
from .process import ManagedProcess, start_process, wait_until

GIE_MODULE: Final = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION: Final = "v1.2.0"
CRD_SUBDIR: Final = "config/crd/bases"
CLIENT_DIR: Final = Path(__file__).resolve().parent.parent / "gie_client"
CLIENT_SOURCES: Final = ("go.mod", "go.sum", "main.go")

EPP_IMAGE_NAME: Final = "gie-epp"
EPP_BINARY: Final = "epp"
CEL_TEST_BINARY: Final = "gie-cel.test"
CLIENT_BINARY: Final = "gie-client"

# as upstream's Dockerfile stamps it (version.BuildRef, logged at start), stripped and static
_EPP_LDFLAGS: Final = (
    f"-ldflags=-s -w -X {GIE_MODULE}/version.BuildRef={GIE_VERSION} -X {GIE_MODULE}/version.CommitSHA=splitserve-e2e"
)


@dataclasses.dataclass(frozen=True)
class GieBinaries:
    """Absolute paths of the GIE executables the e2e test runs."""

    epp: Path
    cel_test: Path
    """Upstream's InferencePool CEL validation tests (``go test -c ./test/cel``)."""
    client: Path


def module_dir() -> Path:
    """The module's directory in the Go module cache (downloaded when missing)."""
    return download_module(GIE_MODULE, GIE_VERSION)


def _go_env(name: str) -> str:
    result = subprocess.run(["go", "env", name], capture_output=True, text=True, check=False)
    return result.stdout.strip()


# --------------------------------------------------------------------------- CRDs
def _crd_dir() -> Path:
    return cache_root() / "gie" / f"crds-{GIE_VERSION}"


def ensure_gie_crds() -> list[Path]:
    """The GIE CRD manifests (``config/crd/bases`` of the pinned module), copied once into the
    cache; sorted paths, for ``kubectl apply --server-side -f``."""
    directory = _crd_dir()
    stamp = directory / STAMP_NAME
    if not stamp.is_file():
        with exclusive(directory.with_name(directory.name + ".lock")):
            if not stamp.is_file():
                source = module_dir() / CRD_SUBDIR
                directory.mkdir(parents=True, exist_ok=True)
                names = sorted(p.name for p in source.glob("*.yaml"))
                if not names:
                    raise BuildError(f"no CRD manifests in {source}")
                for name in names:
                    shutil.copyfile(source / name, directory / name)
                stamp.write_text(json.dumps({"version": GIE_VERSION, "files": names}))
    names = json.loads(stamp.read_text())["files"]
    return [directory / name for name in names]


# --------------------------------------------------------------------------- Go builds
@dataclasses.dataclass(frozen=True)
class _GoBuild:
    """Outputs of one or more Go invocations in one workdir, cached in one directory."""

    group: _ToolGroup
    """Name, version (the stamp's key) and binaries; ``go_args`` is the recipe recorded."""
    steps: tuple[tuple[str, ...], ...]
    directory: Path


def _epp_build() -> _GoBuild:
    steps = (
        ("build", "-trimpath", _EPP_LDFLAGS, "-o", f"{{out}}/{EPP_BINARY}", "./cmd/epp"),
        ("test", "-c", "-trimpath", "-ldflags=-s -w", "-o", f"{{out}}/{CEL_TEST_BINARY}", "./test/cel"),
    )
    group = _ToolGroup(
        name="gie-epp",
        version=GIE_VERSION,
        binaries=(EPP_BINARY, CEL_TEST_BINARY),
        go_args=tuple(arg for step in steps for arg in (*step, ";")),
        workdir=None,
    )
    return _GoBuild(group=group, steps=steps, directory=cache_root() / "bin" / f"gie-epp-{GIE_VERSION}")


def _client_sources_hash() -> str:
    digest = hashlib.sha256()
    for name in CLIENT_SOURCES:
        digest.update(name.encode() + b"\0" + (CLIENT_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _client_build() -> _GoBuild:
    steps = (("build", "-trimpath", "-ldflags=-s -w", "-o", f"{{out}}/{CLIENT_BINARY}", "."),)
    group = _ToolGroup(
        name="gie-client",
        version=f"src-{_client_sources_hash()}",
        binaries=(CLIENT_BINARY,),
        go_args=steps[0],
        workdir=CLIENT_DIR,
    )
    return _GoBuild(group=group, steps=steps, directory=cache_root() / "bin" / "gie-client")


def _scratch_module_copy() -> Path:
    return writable_module_copy(module_dir(), name=f"gie-{GIE_VERSION}")


def _ensure(build: _GoBuild, *, workdir: Path | None) -> tuple[Path, float]:
    """Build ``build`` unless its stamp is current; returns the directory and the seconds
    spent (0.0 when reused). ``workdir`` None: the scratch copy of the GIE module."""
    group, directory = build.group, build.directory
    if _is_complete(group, directory):
        return directory, 0.0
    with exclusive(directory.with_name(directory.name + ".lock")):
        if _is_complete(group, directory):
            return directory, 0.0
        directory.mkdir(parents=True, exist_ok=True)
        _log(f"building {group.name} {group.version} into {directory}")
        env = dict(os.environ, CGO_ENABLED="0")
        env.setdefault("GOFLAGS", "-buildvcs=false")
        started = time.monotonic()
        where = workdir if workdir is not None else _scratch_module_copy()
        for index, step in enumerate(build.steps):
            args = [arg.replace("{out}", str(directory)) for arg in step]
            try:
                _run_go(args=args, workdir=where, env=env, label=f"{group.name}-{group.version}-{index}")
            except BuildError as error:
                raise BuildError(f"{error}\n{_proxy_hint(str(error))}") from error
        elapsed = time.monotonic() - started
        missing = [b for b in group.binaries if not os.access(directory / b, os.X_OK)]
        if missing:
            raise BuildError(f"go finished but {missing} are missing in {directory}")
        (directory / STAMP_NAME).write_text(
            json.dumps(
                {
                    "version": group.version,
                    "recipe": list(group.go_args),
                    "binaries": list(group.binaries),
                    "build_seconds": round(elapsed, 1),
                    "built_at": time.time(),
                }
            )
        )
        _log(f"built {group.name} {group.version} in {elapsed:.0f}s")
        return directory, elapsed


def _proxy_hint(log_tail: str) -> str:
    """What to try when the module proxy or the checksum database refused a dependency."""
    settings = ", ".join(f"{name}={_go_env(name)!r}" for name in ("GOPROXY", "GOSUMDB", "GONOSUMDB", "GOFLAGS"))
    if "403" in log_tail or "410" in log_tail or "not available" in log_tail:
        return (
            f"the module proxy refused a dependency ({settings}); every module of the "
            f"release's go.sum must be downloadable at its exact version"
        )
    if "sum.golang.org" in log_tail or "verifying" in log_tail:
        return f"the checksum database was not reachable ({settings}); try GOSUMDB=off"
    return f"go settings: {settings}"


def ensure_epp() -> Path:
    """The Endpoint Picker binary of GIE ``v1.2.0`` (built once, then cached)."""
    directory, _ = _ensure(_epp_build(), workdir=None)
    return directory / EPP_BINARY


def ensure_cel_tests() -> Path:
    """Upstream's InferencePool CEL validation test binary (built with the picker)."""
    directory, _ = _ensure(_epp_build(), workdir=None)
    return directory / CEL_TEST_BINARY


def ensure_gie_client() -> Path:
    """The ext_proc client of ``e2e/gie_client`` (rebuilt when its sources change)."""
    directory, _ = _ensure(_client_build(), workdir=CLIENT_DIR)
    return directory / CLIENT_BINARY


def ensure_gie_binaries() -> GieBinaries:
    """Build (idempotent) and return every GIE executable."""
    return GieBinaries(epp=ensure_epp(), cel_test=ensure_cel_tests(), client=ensure_gie_client())


def recorded_build_seconds() -> dict[str, float]:
    """Build durations from the stamps (for reports); builds not done are absent."""
    seconds: dict[str, float] = {}
    for build in (_epp_build(), _client_build()):
        stamp = build.directory / STAMP_NAME
        if stamp.is_file():
            recorded = json.loads(stamp.read_text())
            seconds[f"{build.group.name}-{recorded.get('version')}"] = float(recorded.get("build_seconds", 0.0))
    return seconds


# --------------------------------------------------------------------------- the picker's image
def ensure_epp_image() -> str:
    """The picker as an image in the loopback registry (``127.0.0.1:5000/gie-epp:v1.2.0-<id>``,
    the id from the image's digest, so a rebuilt binary gets a new tag): ``/epp`` (static) as
    entrypoint, user 65532 and an empty ``/tmp``, like upstream's distroless image. Written with
    :mod:`.ociimage` and pushed with ``skopeo copy`` once; later calls find the tag."""
    epp = ensure_epp()
    spec = ImageSpec(
        reference=f"{EPP_IMAGE_NAME}:{GIE_VERSION}",
        files={
            "/epp": ImageFile(epp.read_bytes(), 0o755),
            "/etc/passwd": ImageFile(b"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"),
            "/etc/group": ImageFile(b"nonroot:x:65532:\n"),
        },
        directories=("/tmp", "/home/nonroot"),
        entrypoint=("/epp",),
        user="65532:65532",
        env=(),
    )
    directory = cache_root() / "gie"
    archive = directory / f"{EPP_IMAGE_NAME}.oci.tar"
    with exclusive(directory / f"{EPP_IMAGE_NAME}.lock"):
        digest = write_oci_archive(spec, path=archive)
        registry = ensure_registry()
        tag = f"{GIE_VERSION}-{digest.split(':', 1)[1][:12]}"
        reference = f"{registry}/{EPP_IMAGE_NAME}:{tag}"
        found = httpx.head(
            f"http://{registry}/v2/{EPP_IMAGE_NAME}/manifests/{tag}",
            timeout=5.0,
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        if found.status_code != 200:
            skopeo = shutil.which("skopeo")
            if skopeo is None:
                raise BuildError("skopeo is not installed (Debian package skopeo; .ci/deps)")
            started = time.monotonic()
            result = subprocess.run(
                [
                    skopeo,
                    "copy",
                    "--quiet",
                    "--dest-tls-verify=false",
                    f"oci-archive:{archive}",
                    f"docker://{reference}",
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=300,
            )
            if result.returncode != 0:
                raise BuildError(f"skopeo copy to {reference} failed: {result.stderr}")
            _log(f"pushed {reference} in {time.monotonic() - started:.1f}s")
        archive.unlink(missing_ok=True)
    return reference


# --------------------------------------------------------------------------- the picker at work
class PickerError(RuntimeError):
    """The client could not get an answer from the picker (the message has its stderr)."""


@dataclasses.dataclass(frozen=True)
class Pick:
    """What the picker answered to one request (:func:`pick`)."""

    endpoint: str
    """The chosen ``IP:port``; empty when the picker answered with an immediate response."""
    metadata_endpoint: str
    body: dict[str, Any]
    """The request body as the picker passes it on (it may rewrite the model)."""
    immediate_status: int
    immediate_body: str
    seconds: float


def pick(
    client: Path,
    *,
    address: str,
    body: Mapping[str, Any],
    subset: Sequence[str] = (),
    plaintext: bool = False,
    timeout_seconds: float = 30.0,
) -> Pick:
    """Send one OpenAI request's headers and ``body`` to the picker at ``address``; ``subset``
    (``IP:port``s) is the gateway's candidate hint (``envoy.lb.subset_hint``)."""
    argv = [str(client), "-addr", address, "-body", json.dumps(dict(body)), "-timeout", f"{timeout_seconds:.0f}s"]
    if subset:
        argv += ["-subset", ",".join(subset)]
    if plaintext:
        argv.append("-plaintext")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds + 10, check=False)
    if result.returncode not in (0, 3):
        raise PickerError(f"gie-client exited {result.returncode}: {result.stderr.strip()} {result.stdout.strip()}")
    answer = json.loads(result.stdout)
    return Pick(
        endpoint=answer["endpoint"],
        metadata_endpoint=answer["metadata_endpoint"],
        body=json.loads(answer["body"]) if answer["body"] else {},
        immediate_status=int(answer["immediate_status"]),
        immediate_body=answer["immediate_body"],
        seconds=float(answer["seconds"]),
    )


@dataclasses.dataclass
class EndpointPicker:
    """A running picker: where it listens, and its process when :func:`start_epp` started it
    (None: a pod's, e.g. ``EndpointPicker(grpc_address=f"{ip}:9002",
    metrics_url=f"http://{ip}:9090/metrics")``)."""

    grpc_address: str
    metrics_url: str
    process: ManagedProcess | None = None
    argv: tuple[str, ...] = ()

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The picker's own Prometheus metrics: name -> [(labels, value)] (samples)."""
        text = httpx.get(self.metrics_url, timeout=5.0).raise_for_status().text
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        return out

    def stop(self) -> int | None:
        return self.process.stop(grace_seconds=10.0) if self.process is not None else None


def without_flags(args: Sequence[str], names: Sequence[str]) -> list[str]:
    """``args`` without the flags ``names`` (``--name value`` and ``--name=value`` forms), e.g.
    a rendered picker's ports before :func:`start_epp` chooses free ones."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out


PORT_FLAGS: Final = ("--grpc-port", "--grpc-health-port", "--metrics-port")


def start_epp(
    *,
    binary: Path,
    kubeconfig: Path,
    args: Sequence[str],
    log_path: Path,
    verbosity: int = 2,
    refresh_prometheus_seconds: float = 1.0,
    start_timeout_seconds: float = 60.0,
) -> EndpointPicker:
    """Run the picker on the host with ``args`` (e.g. a rendered picker Deployment's, less its
    ports: :func:`without_flags`), authenticated by ``kubeconfig``, on free ports; returns once
    its ext_proc port accepts connections. ``verbosity`` 7 adds, every 5 s, a dump of what it scraped
    from each pod (v1.2.0 logs it at V(DEBUG).V(VERBOSE), and logr adds the levels: 4 + 3); its
    pool averages are flushed every ``refresh_prometheus_seconds``."""
    for flag in (*PORT_FLAGS, "--kubeconfig"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in args):
            raise ValueError(f"start_epp chooses {flag} itself; drop it from args")
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    argv = (
        str(binary),
        *args,
        "--kubeconfig",
        str(kubeconfig),
        "--grpc-port",
        str(grpc_port),
        "--grpc-health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
        "-v",
        str(verbosity),
        f"--refresh-prometheus-metrics-interval={refresh_prometheus_seconds}s",
    )
    process = start_process(name="epp", argv=argv, log_path=log_path, pid_dir=None)
    try:
        wait_until(
            lambda: port_open(host=LOOPBACK, port=grpc_port),
            alive=process,
            timeout_seconds=start_timeout_seconds,
            what="the picker's ext_proc port",
        )
    except BaseException:
        process.stop()
        raise
    return EndpointPicker(
        grpc_address=f"{LOOPBACK}:{grpc_port}",
        process=process,
        metrics_url=f"http://{LOOPBACK}:{metrics_port}/metrics",
        argv=argv,
    )


def main() -> int:
    started = time.monotonic()
    try:
        crds = ensure_gie_crds()
        binaries = ensure_gie_binaries()
    except BuildError as error:
        _log(f"FAILED: {error}")
        return 1
    for path in crds:
        print(f"{'crd':24} {path}")
    for field in dataclasses.fields(binaries):
        print(f"{field.name:24} {getattr(binaries, field.name)}")
    for name, seconds in recorded_build_seconds().items():
        print(f"build time {name:24} {seconds:.0f}s")
    print(f"ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
