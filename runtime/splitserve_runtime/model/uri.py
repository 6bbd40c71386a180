"""Resolve a model URI to a local directory, offline.

The runtime never downloads: weights arrive through a volume the operator mounts or a cache
something else filled. Accepted forms:

- ``hf://org/name[@revision]``: looked up in ``cache_dir``, else ``$SPLITSERVE_MODEL_CACHE``,
  else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``. Within that
  root either a plain ``org/name/`` directory (no revision allowed) or the Hugging Face hub
  cache layout ``models--org--name/snapshots/<commit>/``, where the revision is a commit hash
  or a name in ``refs/`` (default ``main``; with no ``refs/main`` a single snapshot is used).
- ``pvc://claim/path``: the PersistentVolumeClaim ``claim`` is mounted by the operator at
  ``/models/<claim>`` (:data:`PVC_MOUNT_ROOT`), so this resolves to ``/models/<claim>/<path>``.
- ``file:///abs/path`` and plain paths: used as they are.

Every form must end at a directory holding ``config.json``; otherwise a
:class:`ModelLoadError` says what was looked for where. Torch-free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from splitserve_contract import ENV_MODEL_CACHE

from .errors import ModelLoadError

PVC_MOUNT_ROOT = Path("/models")
"""Where the operator mounts a ``pvc://claim/...`` volume: ``PVC_MOUNT_ROOT / claim``."""

_HF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hf_cache_root(*, cache_dir: Path | None) -> Path:
    """The directory ``hf://`` URIs are looked up in (see module docstring for the order)."""
    if cache_dir is not None:
        return cache_dir
    for env in (ENV_MODEL_CACHE, "HF_HUB_CACHE"):
        value = os.environ.get(env)
        if value:
            return Path(value)
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _require_model_dir(path: Path, uri: str) -> Path:
    if not path.is_dir():
        raise ModelLoadError(f"model {uri!r}: directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {uri!r}: {path} has no config.json")
    return path


def _resolve_hf(spec: str, *, uri: str, revision: str, cache_dir: Path | None) -> Path:
    name, _, uri_revision = spec.partition("@")
    if uri_revision and revision and uri_revision != revision:
        raise ModelLoadError(
            f"model {uri!r}: revision {uri_revision!r} in the URI conflicts with revision {revision!r}"
        )
    revision = uri_revision or revision
    if not _HF_NAME.match(name):
        raise ModelLoadError(f"model {uri!r}: expected hf://org/name[@revision]")
    root = hf_cache_root(cache_dir=cache_dir)
    plain = root / name
    if not revision and (plain / "config.json").is_file():
        return plain
    repo = root / ("models--" + name.replace("/", "--"))
    if not repo.is_dir():
        raise ModelLoadError(
            f"model {uri!r} is not in the local cache {root} (looked for {plain} and {repo}; "
            f"nothing is downloaded: pre-fill the cache or set {ENV_MODEL_CACHE})"
        )
    snapshots = repo / "snapshots"
    ref = revision or "main"
    if _COMMIT.match(ref):
        commit = ref
    elif (repo / "refs" / ref).is_file():
        commit = (repo / "refs" / ref).read_text(encoding="utf-8").strip()
    elif not revision and snapshots.is_dir() and len(list(snapshots.iterdir())) == 1:
        commit = next(snapshots.iterdir()).name
    else:
        raise ModelLoadError(f"model {uri!r}: revision {ref!r} not found under {repo / 'refs'}")
    return _require_model_dir(snapshots / commit, uri)


def resolve_model_uri(
    uri: str, *, cache_dir: Path | None, revision: str = "", pvc_mount_root: Path = PVC_MOUNT_ROOT,
) -> Path:
    """Local directory for ``uri`` (``revision`` only applies to ``hf://``)."""
    if not uri:
        raise ModelLoadError("no model given (expected hf://org/name, pvc://claim/path, file:///path or a path)")
    if uri.startswith("hf://"):
        return _resolve_hf(uri[len("hf://") :], uri=uri, revision=revision, cache_dir=cache_dir)
    if revision:
        raise ModelLoadError(f"model {uri!r}: a revision only applies to hf:// URIs")
    if uri.startswith("pvc://"):
        claim, _, sub_path = uri[len("pvc://") :].partition("/")
        if not claim or ".." in Path(sub_path).parts:
            raise ModelLoadError(f"model {uri!r}: expected pvc://claim/path without '..'")
        return _require_model_dir(pvc_mount_root / claim / sub_path, uri)
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise ModelLoadError(f"model {uri!r}: file:// URIs need an absolute path (file:///...)")
        return _require_model_dir(Path(path), uri)
    if "://" in uri:
        raise ModelLoadError(
            f"model {uri!r}: unsupported scheme; use hf://, pvc://, file:// or a plain path"
        )
    return _require_model_dir(Path(uri).expanduser(), uri)
