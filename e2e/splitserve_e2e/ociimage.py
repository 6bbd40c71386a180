"""Tiny single-layer OCI images written by hand, for the kubelet node.

The kubelet node (:mod:`splitserve_e2e.kubeletnode`) needs a sandbox ("pause") image and a test
image, and this machine has no registry.k8s.io, no Docker Hub and no image builder daemon. An
OCI image is only a tar layer, a JSON config, a JSON manifest and an index, so writing one from
Python is shorter and more deterministic than driving umoci/skopeo: the same inputs give the
same digests, which makes ``ctr images import`` of an unchanged image a no-op. The index
carries containerd's ``io.containerd.image.name`` annotation, so the import gets exactly the
reference pods name (``ctr`` otherwise prefixes ``import-<date>/``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

IMAGE_NAME_ANNOTATION = "io.containerd.image.name"
_LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
_CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
_MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"


@dataclasses.dataclass(frozen=True)
class ImageFile:
    """One regular file of the layer."""

    content: bytes
    mode: int = 0o644


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What goes into one image: files, symlinks, directories and the process defaults."""

    reference: str  # full name, e.g. "splitserve.local/pause:1"
    files: Mapping[str, ImageFile]
    symlinks: Mapping[str, str] = dataclasses.field(default_factory=dict)
    directories: Sequence[str] = ()
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    user: str = ""
    workdir: str = "/"
    env: Sequence[str] = ("PATH=/bin",)


def _layer(spec: ImageSpec) -> bytes:
    """An uncompressed, reproducible tar (fixed mtimes, uid/gid 0, sorted entries)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parents = {str(Path(p).parent).lstrip("/") for p in [*spec.files, *spec.symlinks]}
        for directory in sorted({*parents, *(d.strip("/") for d in spec.directories)} - {""}):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, link in sorted(spec.symlinks.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, link, 0o777
            tar.addfile(info)
        for path, file in sorted(spec.files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode = len(file.content), file.mode
            tar.addfile(info, io.BytesIO(file.content))
    return buffer.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _json(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def write_oci_archive(spec: ImageSpec, *, path: Path) -> str:
    """Write ``spec`` as an OCI image-layout tar at ``path``; returns the manifest digest."""
    blobs: dict[str, bytes] = {}
    layer = _layer(spec)
    layer_descriptor = _blob(blobs, layer, _LAYER_MEDIA_TYPE)
    config: dict[str, Any] = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": list(spec.env), "WorkingDir": spec.workdir},
        "rootfs": {"type": "layers", "diff_ids": [layer_descriptor["digest"]]},
    }
    if spec.entrypoint:
        config["config"]["Entrypoint"] = list(spec.entrypoint)
    if spec.cmd:
        config["config"]["Cmd"] = list(spec.cmd)
    if spec.user:
        config["config"]["User"] = spec.user
    manifest = {
        "schemaVersion": 2,
        "mediaType": _MANIFEST_MEDIA_TYPE,
        "config": _blob(blobs, _json(config), _CONFIG_MEDIA_TYPE),
        "layers": [layer_descriptor],
    }
    manifest_descriptor = _blob(blobs, _json(manifest), _MANIFEST_MEDIA_TYPE)
    manifest_descriptor["annotations"] = {
        IMAGE_NAME_ANNOTATION: spec.reference,
        "org.opencontainers.image.ref.name": spec.reference,
    }
    manifest_descriptor["platform"] = {"architecture": "amd64", "os": "linux"}
    index = {"schemaVersion": 2, "manifests": [manifest_descriptor]}
    entries = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": _json(index)}
    entries.update({f"blobs/sha256/{d.split(':', 1)[1]}": data for d, data in blobs.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode="w") as tar:
        for name in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in sorted(entries.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return str(manifest_descriptor["digest"])


def pause_image(*, pause_binary: Path, reference: str) -> ImageSpec:
    """The sandbox image: the static pause binary, run as nobody like Kubernetes' pause."""
    return ImageSpec(
        reference=reference,
        files={"/pause": ImageFile(pause_binary.read_bytes(), 0o755)},
        entrypoint=("/pause",),
        user="65535:65535",
    )


def busybox_image(*, reference: str, extra_binaries: Sequence[Path] = (), busybox: Path | None = None) -> ImageSpec:
    """A test image: Debian's static busybox with a symlink per applet, ``extra_binaries``
    (static) in ``/bin``, an httpd document root ``/www`` and a non-root default user (65534,
    so ``runAsNonRoot`` pods need no runAsUser). Busybox's ``wget -T`` segfaults (Debian
    1.35): use ``timeout N wget``."""
    binary = busybox or Path(shutil.which("busybox") or "/bin/busybox")
    listing = subprocess.run([str(binary), "--list"], capture_output=True, text=True, check=True)
    applets = sorted({name for name in listing.stdout.split() if name and name != "busybox"})
    return ImageSpec(
        reference=reference,
        files={
            "/bin/busybox": ImageFile(binary.read_bytes(), 0o755),
            "/www/index.html": ImageFile(b"splitserve kubelet node\n"),
            "/etc/passwd": ImageFile(b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"),
            "/etc/group": ImageFile(b"root:x:0:\nnogroup:x:65534:\n"),
            **{f"/bin/{path.name}": ImageFile(path.read_bytes(), 0o755) for path in extra_binaries},
        },
        symlinks={f"/bin/{applet}": "busybox" for applet in applets},
        directories=("/tmp", "/proc", "/sys", "/dev", "/etc"),
        cmd=("/bin/sh",),
        user="65534:65534",
    )
