"""Download an ``hf://`` model from the hub into the runtime's model cache.

Why: in production weights reach pods from a model hub (huggingface.co or a private mirror),
not from a directory someone filled by hand. :func:`download_hf_model` fetches one revision
with ``huggingface_hub`` into the standard hub cache layout
(``models--org--name/{blobs,snapshots/<commit>,refs}``), so :mod:`.uri` resolves it exactly
like a cache filled any other way, and so does the next pod that shares the volume.

- Only what the runtime reads is fetched (:func:`wanted`): ``config.json``,
  ``generation_config.json``, the tokenizer files and the ``*.safetensors`` weights with their
  index, all at the repository root. ``*.bin``, ``*.gguf``, ``*.onnx``, ``*.pt`` and the rest
  are never downloaded — except the one ``.gguf`` file an ``hf://org/name/<file>.gguf`` URI
  names (:func:`download_hf_file`).
- The revision (branch, tag or commit) is resolved once to a commit and every file is fetched
  at that commit, so a branch that moves mid-download cannot mix two commits; ``refs/<rev>``
  is written last, atomically. ``config.json`` is fetched after everything else: a snapshot
  with ``config.json`` is complete, which is what the resolver checks.
- Pods that share a cache volume may download at once: ``huggingface_hub`` takes a file lock
  per blob (``.locks/``) and moves finished blobs into place, so nobody reads a half file.
- The endpoint and token are passed explicitly (``huggingface_hub`` reads ``HF_ENDPOINT`` at
  import time): :meth:`HubSettings.from_env` reads ``HF_ENDPOINT``, ``HF_TOKEN`` and
  ``SPLITSERVE_HUB_TOKEN_SOURCE`` (which Secret the operator took the token from).
- Progress goes to the pod log: a line per file with its size, a final line with the total
  bytes and seconds. Every failure is a :class:`ModelLoadError` that says what the hub answered
  (HTTP 401/403: the token was refused, naming its Secret; 404: no such repository, revision
  or file; the endpoint could not be reached, naming it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from splitserve_contract import ENV_HUB_ENDPOINT, ENV_HUB_TOKEN, ENV_HUB_TOKEN_SOURCE

from .errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT: Final = "https://huggingface.co"
CONFIG_FILE: Final = "config.json"
RUNTIME_FILES: Final = frozenset({
    CONFIG_FILE, "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
})
"""Files the runtime reads besides the weights (config, generation defaults, tokenizer)."""
WEIGHT_SUFFIXES: Final = (".safetensors", ".safetensors.index.json")
MAX_PARALLEL_FILES: Final = 8
ETAG_TIMEOUT_SECONDS: Final = 30.0


def wanted(path: str) -> bool:
    """Whether the runtime needs the repository file ``path`` (root-level files only)."""
    if "/" in path:
        return False
    return path in RUNTIME_FILES or path.endswith(WEIGHT_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class HubSettings:
    """Where to download from and with which token."""

    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = None
    token_source: str = ""
    """Where the token came from, in words, for messages (e.g. ``Secret hf, key HF_TOKEN``)."""

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise ModelLoadError(
                f"{ENV_HUB_ENDPOINT}={self.endpoint!r} is not an http:// or https:// URL")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HubSettings:
        env = os.environ if environ is None else environ
        endpoint = (env.get(ENV_HUB_ENDPOINT) or DEFAULT_ENDPOINT).rstrip("/")
        token = env.get(ENV_HUB_TOKEN) or None
        source = env.get(ENV_HUB_TOKEN_SOURCE) or ""
        return cls(endpoint=endpoint, token=token, token_source=source)

    def describe_token(self) -> str:
        if self.token is None:
            return f"no token was sent ({ENV_HUB_TOKEN} is not set; set spec.model.hubTokenSecretRef)"
        where = f" from {self.token_source}" if self.token_source else ""
        return f"the hub refused the token in {ENV_HUB_TOKEN}{where}"


def download_hf_model(
    *, uri: str, repo_id: str, revision: str, cache_root: Path, hub: HubSettings,
    weights: bool = True,
) -> Path:
    """Fetch the runtime's files of ``repo_id`` at ``revision`` (empty: ``main``) into
    ``cache_root`` and return the snapshot directory. ``weights=False`` fetches the config and
    tokenizer only (what the router reads)."""
    revision = revision or "main"
    prefix = (f"model {uri!r} is not in the local cache {cache_root} and could not be "
              f"downloaded from {hub.endpoint}")
    try:
        return _download(repo_id=repo_id, revision=revision, cache_root=cache_root, hub=hub,
                         weights=weights)
    except ModelLoadError as error:
        raise ModelLoadError(f"{prefix}: {error}") from error
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear message
        raise ModelLoadError(
            f"{prefix}: {_explain(error, repo_id=repo_id, revision=revision, hub=hub, cache_root=cache_root)}"
        ) from error


def download_hf_file(*, uri: str, repo_id: str, filename: str, revision: str, cache_root: Path,
                     hub: HubSettings) -> Path:
    """Fetch one file (a ``.gguf`` model) of ``repo_id`` at ``revision`` into ``cache_root``'s
    hub layout; returns its path in the snapshot. Failures as :func:`download_hf_model`'s."""
    revision = revision or "main"
    prefix = (f"model {uri!r} is not in the local cache {cache_root} and could not be "
              f"downloaded from {hub.endpoint}")
    try:
        started = time.monotonic()
        from huggingface_hub import HfApi

        info = HfApi(endpoint=hub.endpoint, token=hub.token or False).model_info(
            repo_id, revision=revision, files_metadata=True)
        commit = info.sha
        if not commit:
            raise ModelLoadError(f"the hub named no commit for {repo_id}@{revision}")
        names = sorted(s.rfilename for s in info.siblings or [])
        if filename not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise ModelLoadError(f"{repo_id}@{revision} (commit {commit}) has no file {filename!r} "
                                 f"(GGUF files: {', '.join(ggufs) or 'none'})")
        log.info("downloading %s from %s@%s (commit %s) at %s into %s",
                 filename, repo_id, revision, commit, hub.endpoint, cache_root)
        cache_root.mkdir(parents=True, exist_ok=True)
        size = _fetch_file(repo_id=repo_id, filename=filename, commit=commit, cache_root=cache_root, hub=hub)
        repo_dir = cache_root / ("models--" + repo_id.replace("/", "--"))
        if revision != commit:
            _write_ref(repo_dir / "refs" / revision, commit)
        log.info("downloaded %s: %d bytes in %.2f s", filename, size, time.monotonic() - started)
        return repo_dir / "snapshots" / commit / filename
    except ModelLoadError as error:
        raise ModelLoadError(f"{prefix}: {error}") from error
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear message
        raise ModelLoadError(
            f"{prefix}: {_explain(error, repo_id=repo_id, revision=revision, hub=hub, cache_root=cache_root)}"
        ) from error


def _download(*, repo_id: str, revision: str, cache_root: Path, hub: HubSettings,
              weights: bool) -> Path:
    from huggingface_hub import HfApi

    # httpx2 logs every request at INFO; the pod log gets one line per file from us instead.
    logging.getLogger("httpx2").setLevel(max(logging.getLogger("httpx2").getEffectiveLevel(), logging.WARNING))
    started = time.monotonic()
    api = HfApi(endpoint=hub.endpoint, token=hub.token or False)
    info = api.model_info(repo_id, revision=revision, files_metadata=True)
    commit = info.sha
    if not commit:
        raise ModelLoadError(f"the hub named no commit for {repo_id}@{revision}")
    siblings = {s.rfilename: s.size for s in info.siblings or []}
    files = sorted(name for name in siblings if wanted(name))
    skipped = sorted(name for name in siblings if not wanted(name))
    if CONFIG_FILE not in files:
        raise ModelLoadError(f"{repo_id}@{revision} (commit {commit}) has no {CONFIG_FILE}")
    if not any(name.endswith(".safetensors") for name in files):
        raise ModelLoadError(
            f"{repo_id}@{revision} (commit {commit}) has no *.safetensors weights "
            f"(files: {', '.join(sorted(siblings)) or 'none'}); this runtime loads safetensors only")
    if not weights:
        files = [name for name in files if not name.endswith(WEIGHT_SUFFIXES)]
    planned = sum(siblings[name] or 0 for name in files)
    log.info("downloading %s@%s (commit %s) from %s into %s: %d files, %s%s",
             repo_id, revision, commit, hub.endpoint, cache_root, len(files), _size(planned),
             f"; not fetched: {', '.join(skipped)}" if skipped else "")
    cache_root.mkdir(parents=True, exist_ok=True)
    rest = [name for name in files if name != CONFIG_FILE]
    total = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(rest) or 1)) as pool:
        futures = {pool.submit(_fetch_file, repo_id=repo_id, filename=name, commit=commit,
                               cache_root=cache_root, hub=hub): name for name in rest}
        for future in concurrent.futures.as_completed(futures):
            total += future.result()
    total += _fetch_file(repo_id=repo_id, filename=CONFIG_FILE, commit=commit, cache_root=cache_root, hub=hub)
    repo_dir = cache_root / ("models--" + repo_id.replace("/", "--"))
    if revision != commit:
        _write_ref(repo_dir / "refs" / revision, commit)
    seconds = time.monotonic() - started
    log.info("downloaded %s@%s (commit %s): %d files, %d bytes in %.2f s (%s/s)",
             repo_id, revision, commit, len(files), total, seconds, _size(total / max(seconds, 1e-6)))
    return repo_dir / "snapshots" / commit


def _fetch_file(*, repo_id: str, filename: str, commit: str, cache_root: Path, hub: HubSettings) -> int:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils.tqdm import silent_tqdm

    started = time.monotonic()
    path = Path(hf_hub_download(
        repo_id, filename, revision=commit, cache_dir=cache_root, endpoint=hub.endpoint,
        token=hub.token or False, etag_timeout=ETAG_TIMEOUT_SECONDS,
        tqdm_class=silent_tqdm,  # no progress bars in pod logs
    ))
    size = path.stat().st_size
    log.info("fetched %s (%s, %d bytes) in %.2f s", filename, _size(size), size, time.monotonic() - started)
    return size


def _write_ref(path: Path, commit: str) -> None:
    """``refs/<revision>`` -> commit, replaced atomically so a concurrent reader never sees a
    partial ref."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_text(encoding="utf-8").strip() == commit:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(commit)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _explain(error: BaseException, *, repo_id: str, revision: str, hub: HubSettings, cache_root: Path) -> str:
    """One sentence for what went wrong, from anywhere in the exception chain (``huggingface_hub``
    sometimes raises 'not in the local cache' on top of the hub's answer)."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    chain = _chain(error)

    def find(*types: type[BaseException]) -> BaseException | None:
        return next((e for e in chain if isinstance(e, types)), None)

    if (cause := find(httpx2.ConnectError, httpx2.TimeoutException)) is not None:
        return (f"the hub endpoint {hub.endpoint} is unreachable ({type(cause).__name__}: "
                f"{_first_line(cause)}); check {ENV_HUB_ENDPOINT} (spec.model.hubEndpoint)")
    if find(RevisionNotFoundError) is not None:
        return f"HTTP 404: repository {repo_id} has no revision {revision!r}"
    if (cause := find(RemoteEntryNotFoundError)) is not None:
        return f"HTTP 404: a file of {repo_id}@{revision} is missing on the hub ({_first_line(cause)})"
    if (cause := find(GatedRepoError)) is not None:
        return (f"HTTP {_status(cause)}: {repo_id} is gated and {hub.describe_token()} "
                "(accept the model's terms with the token's account)")
    if (cause := find(RepositoryNotFoundError)) is not None:
        status = _status(cause)
        if status in (401, 403):
            return (f"HTTP {status}: no repository {repo_id} is visible: {hub.describe_token()}, "
                    "or the repository does not exist")
        return f"HTTP {status}: no repository {repo_id} on the hub"
    if (cause := find(HfHubHTTPError)) is not None:
        status = _status(cause)
        if status in (401, 403):
            return f"HTTP {status}: {hub.describe_token()}"
        return f"HTTP {status}: {_first_line(cause)}"
    if (cause := find(OSError)) is not None:
        return f"could not write the model cache {cache_root}: {cause}"
    return f"{type(error).__name__}: {_first_line(error)}"


def _chain(error: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _status(error: Any) -> int | str:
    response = getattr(error, "response", None)
    return int(response.status_code) if response is not None else "?"


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(error).__name__


def _size(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
