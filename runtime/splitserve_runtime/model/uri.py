"""Resolve a model URI to a local directory, downloading ``hf://`` models the cache lacks.

Weights arrive through a volume the operator mounts, a cache something else filled, or, for
``hf://`` models missing from the cache, a download from the hub into that cache
(:mod:`.download`), as in production. Accepted forms:

- ``hf://org/name/path/file.gguf[@revision]``: one GGUF file of that repository, from the
  cache's snapshot or downloaded into it, then translated like a local ``.gguf`` file (below).
- ``hf://org/name[@revision]``: looked up in ``cache_dir``, else ``$SPLITSERVE_MODEL_CACHE``,
  else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``. Within that
  root either a plain ``org/name/`` directory (no revision allowed) or the Hugging Face hub
  cache layout ``models--org--name/snapshots/<commit>/``, where the revision is a commit hash
  or a name in ``refs/`` (default ``main``; with no ``refs/main`` a single snapshot is used).
  What the cache lacks is downloaded from ``$HF_ENDPOINT`` into that layout, unless
  ``HF_HUB_OFFLINE=1``: then the cache is all there is. The cache is consulted first, so a
  restarted pod with a filled cache does not need the hub.
- ``pvc://claim/path``: the PersistentVolumeClaim ``claim`` is mounted by the operator at
  ``/models/<claim>`` (:data:`PVC_MOUNT_ROOT`), so this resolves to ``/models/<claim>/<path>``.
- ``file:///abs/path`` and plain paths: used as they are.

A revision (``@revision`` or ``--revision``) must pass the contract's rule
(:func:`splitserve_contract.model_revision.revision_problem`: a plausible branch, tag or
commit hash) before it names a file under ``refs/``, and a ref file must hold a commit hash
before it names a snapshot directory; messages never quote a file's content.

Every form must end at a directory holding ``config.json``, or (``pvc://``, ``file://``, plain
paths) at a ``.gguf`` file, whose config and tokenizer are translated into a directory under
the cache root (:func:`.gguf.materialize_gguf_dir`); otherwise a
:class:`ModelLoadError` says what was looked for where. Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from splitserve_contract import ENV_HUB_OFFLINE, ENV_MODEL_CACHE
from splitserve_contract.model_revision import revision_problem

from .errors import ModelLoadError

PVC_MOUNT_ROOT = Path("/models")
"""Where the operator mounts a ``pvc://claim/...`` volume: ``PVC_MOUNT_ROOT / claim``."""

GGUF_SUFFIX = ".gguf"
TOKENIZER_ONLY_DIR = "tokenizer-only"
"""Under the cache root: snapshots downloaded without weights (for the router)."""
_HF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HF_GGUF = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)/((?:[A-Za-z0-9._-]+/)*[A-Za-z0-9._-]+\.gguf)$"
)


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


def _require_model_dir(path: Path, uri: str, *, cache_dir: Path | None = None) -> Path:
    if path.suffix == GGUF_SUFFIX and path.is_file():
        # A GGUF file: its config and tokenizer are translated once into a directory under
        # the cache root (the file itself may sit on a read-only volume); the loader reads
        # the weights from the file.
        from .gguf import materialize_gguf_dir

        return materialize_gguf_dir(path, cache_root=hf_cache_root(cache_dir=cache_dir))
    if not path.is_dir():
        raise ModelLoadError(f"model {uri!r}: directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {uri!r}: {path} has no config.json")
    return path


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value: never download."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_HUB_OFFLINE) or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "true", "yes", "on")


def parse_hf_uri(uri: str, *, revision: str = "") -> tuple[str, str]:
    """``(org/name, revision)`` of an ``hf://`` URI; ``revision`` is the separate setting
    (``--revision``), which must agree with an ``@revision`` in the URI."""
    name, _, uri_revision = uri.removeprefix("hf://").partition("@")
    if uri_revision and revision and uri_revision != revision:
        raise ModelLoadError(
            f"model {uri!r}: revision {uri_revision!r} in the URI conflicts with revision {revision!r}"
        )
    if not _HF_NAME.match(name):
        raise ModelLoadError(f"model {uri!r}: expected hf://org/name[@revision]")
    chosen = uri_revision or revision
    problem = revision_problem(chosen)
    if problem is not None:
        raise ModelLoadError(f"model {uri!r}: {problem}")
    return name, chosen


def _snapshot(name: str, *, uri: str, revision: str, root: Path, also_looked: Path | None = None) -> Path | str:
    """The hub-cache snapshot directory of ``name`` at ``revision`` in ``root``, or why there is
    none (naming ``also_looked`` too, when the caller looked there first)."""
    repo = root / ("models--" + name.replace("/", "--"))
    if not repo.is_dir():
        looked = f"{also_looked} and {repo}" if also_looked is not None else str(repo)
        return f"model {uri!r} is not in the local cache {root} (looked for {looked})"
    snapshots = repo / "snapshots"
    ref = revision or "main"
    if _COMMIT.match(ref):
        commit = ref
    elif (repo / "refs" / ref).is_file():
        commit = _read_ref(repo / "refs" / ref, uri=uri)
    elif not revision and snapshots.is_dir() and len(list(snapshots.iterdir())) == 1:
        commit = next(snapshots.iterdir()).name
    else:
        return f"model {uri!r}: revision {ref!r} not found under {repo / 'refs'}"
    return snapshots / commit


def _read_ref(path: Path, *, uri: str) -> str:
    """The commit hash a ``refs/`` file holds. Anything else is refused without quoting it: the
    content of a file is never put into a message (it could be any file's)."""
    try:
        data = path.read_bytes()[:128]
    except OSError as exc:
        raise ModelLoadError(f"model {uri!r}: cannot read {path} ({exc.strerror or type(exc).__name__})") from None
    commit = data.decode("ascii", "replace").strip()
    if _COMMIT.match(commit) is None:
        raise ModelLoadError(f"model {uri!r}: {path} does not hold a 40-digit commit hash")
    return commit


def _cached_hf(name: str, *, uri: str, revision: str, root: Path) -> Path | str:
    """The snapshot directory of ``name`` at ``revision`` in ``root``, or why there is none."""
    plain = root / name
    if not revision and (plain / "config.json").is_file():
        return plain
    snapshot = _snapshot(name, uri=uri, revision=revision, root=root, also_looked=plain)
    if isinstance(snapshot, str):
        return snapshot
    if not (snapshot / "config.json").is_file():
        # A download writes config.json last, so without it the snapshot is incomplete.
        return f"model {uri!r} is not in the local cache {root} ({snapshot} has no config.json)"
    return snapshot


def split_hf_gguf(uri: str) -> tuple[str, str] | None:
    """``(hf://org/name[@revision], path/in/repo.gguf)`` for an ``hf://org/name/<path>.gguf[@revision]``
    URI (one GGUF file of a repository), else None."""
    body, at, revision = uri.removeprefix("hf://").partition("@")
    match = _HF_GGUF.match(body)
    if match is None:
        return None
    if any(part in (".", "..") for part in match.group(2).split("/")):
        raise ModelLoadError(f"model {uri!r}: the file path in the repository may not contain '.' or '..' segments")
    return f"hf://{match.group(1)}{at}{revision}", match.group(2)


def _resolve_hf_gguf(
    uri: str, *, repo_uri: str, filename: str, revision: str, cache_dir: Path | None, offline: bool | None
) -> Path:
    """One GGUF file of a hub repository: from the cache, else downloaded into it (the router
    needs it too: the tokenizer is inside), then translated like a local GGUF file."""
    name, revision = parse_hf_uri(repo_uri, revision=revision)
    root = hf_cache_root(cache_dir=cache_dir)
    snapshot = _snapshot(name, uri=uri, revision=revision, root=root)
    if isinstance(snapshot, Path) and (snapshot / filename).is_file():
        return _require_model_dir(snapshot / filename, uri, cache_dir=cache_dir)
    if hub_offline() if offline is None else offline:
        why = snapshot if isinstance(snapshot, str) else f"model {uri!r}: {snapshot / filename} is not in the cache"
        raise ModelLoadError(
            f"{why}; {ENV_HUB_OFFLINE} is set, so nothing is downloaded: pre-fill the cache or set {ENV_MODEL_CACHE}"
        )
    from .download import HubSettings, download_hf_file

    path = download_hf_file(
        uri=uri, repo_id=name, filename=filename, revision=revision, cache_root=root, hub=HubSettings.from_env()
    )
    return _require_model_dir(path, uri, cache_dir=cache_dir)


def _resolve_hf(uri: str, *, revision: str, cache_dir: Path | None, offline: bool | None, weights: bool) -> Path:
    gguf_file = split_hf_gguf(uri)
    if gguf_file is not None:
        return _resolve_hf_gguf(
            uri, repo_uri=gguf_file[0], filename=gguf_file[1], revision=revision, cache_dir=cache_dir, offline=offline
        )
    name, revision = parse_hf_uri(uri, revision=revision)
    root = hf_cache_root(cache_dir=cache_dir)
    cached = _cached_hf(name, uri=uri, revision=revision, root=root)
    if isinstance(cached, Path):
        return cached
    if not weights:
        # A snapshot without weights must never look complete to a pod that needs them
        # (config.json marks a finished download), so it lives in a root of its own.
        root = root / TOKENIZER_ONLY_DIR
        cached = _cached_hf(name, uri=uri, revision=revision, root=root)
        if isinstance(cached, Path):
            return cached
    if hub_offline() if offline is None else offline:
        raise ModelLoadError(
            f"{cached}; {ENV_HUB_OFFLINE} is set, so nothing is downloaded: pre-fill the cache or set {ENV_MODEL_CACHE}"
        )
    from .download import HubSettings, download_hf_model

    snapshot = download_hf_model(
        uri=uri, repo_id=name, revision=revision, cache_root=root, hub=HubSettings.from_env(), weights=weights
    )
    return _require_model_dir(snapshot, uri)


def resolve_model_uri(
    uri: str,
    *,
    cache_dir: Path | None,
    revision: str = "",
    pvc_mount_root: Path = PVC_MOUNT_ROOT,
    offline: bool | None = None,
    weights: bool = True,
) -> Path:
    """Local directory for ``uri`` (``revision`` only applies to ``hf://``). An ``hf://`` model
    missing from the cache is downloaded into it unless ``offline`` (default: from
    ``$HF_HUB_OFFLINE``); failures are :class:`ModelLoadError` saying what the hub answered.
    ``weights=False``: the config and tokenizer are enough (the router), so a download skips
    the weights and goes to :data:`TOKENIZER_ONLY_DIR` under the cache root."""
    if not uri:
        raise ModelLoadError("no model given (expected hf://org/name, pvc://claim/path, file:///path or a path)")
    if uri.startswith("hf://"):
        return _resolve_hf(uri, revision=revision, cache_dir=cache_dir, offline=offline, weights=weights)
    if revision:
        raise ModelLoadError(f"model {uri!r}: a revision only applies to hf:// URIs")
    if uri.startswith("pvc://"):
        claim, _, sub_path = uri[len("pvc://") :].partition("/")
        if not claim or ".." in Path(sub_path).parts:
            raise ModelLoadError(f"model {uri!r}: expected pvc://claim/path without '..'")
        return _require_model_dir(pvc_mount_root / claim / sub_path, uri, cache_dir=cache_dir)
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise ModelLoadError(f"model {uri!r}: file:// URIs need an absolute path (file:///...)")
        return _require_model_dir(Path(path), uri, cache_dir=cache_dir)
    if "://" in uri:
        raise ModelLoadError(f"model {uri!r}: unsupported scheme; use hf://, pvc://, file:// or a plain path")
    return _require_model_dir(Path(uri).expanduser(), uri, cache_dir=cache_dir)
