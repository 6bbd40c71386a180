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
- No hub call can wait forever (a hub that accepts connections and never answers would
  otherwise hang start-up with nothing in the log): every request ``huggingface_hub`` makes
  goes through :func:`_bounded_transport`, which caps its connect timeout
  (:attr:`HubTimeouts.connect_seconds`) and its read timeout, including the requests the
  library sends with no timeout at all (its session has none: ``model_info`` without
  ``timeout=``, its own user-agent lookup on the endpoint). A metadata request waits at most
  :attr:`HubTimeouts.request_seconds` (``HF_HUB_ETAG_TIMEOUT``) for data; file downloads are bounded
  by progress, not by size: when no byte has arrived for :attr:`HubTimeouts.stall_seconds`
  (``HF_HUB_DOWNLOAD_TIMEOUT``), the library's own retries are cut short and the load fails
  naming the endpoint. Each call is preceded by a log line naming the endpoint it waits on.
  (Files the hub serves through Xet storage are fetched by ``hf_xet``'s own client, outside
  this transport; the metadata calls before them still are bounded.)
- The revision is checked against the contract's rule
  (:func:`splitserve_contract.model_revision.revision_problem`) before it becomes part of a
  URL or of a path under ``refs/``.
- Progress goes to the pod log: a line per file with its size, a final line with the total
  bytes and seconds. Every failure is a :class:`ModelLoadError` that says what the hub answered
  (HTTP 401/403: the token was refused, naming its Secret; 404: no such repository, revision
  or file; the endpoint could not be reached, naming it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from splitserve_contract import ENV_HUB_ENDPOINT, ENV_HUB_TOKEN, ENV_HUB_TOKEN_SOURCE
from splitserve_contract.model_revision import revision_problem

from .errors import ModelLoadError

if TYPE_CHECKING:
    import httpx2

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT: Final = "https://huggingface.co"
CONFIG_FILE: Final = "config.json"
RUNTIME_FILES: Final = frozenset(
    {
        CONFIG_FILE,
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
"""Files the runtime reads besides the weights (config, generation defaults, tokenizer)."""
WEIGHT_SUFFIXES: Final = (".safetensors", ".safetensors.index.json")
MAX_PARALLEL_FILES: Final = 8
ENV_REQUEST_TIMEOUT: Final = "HF_HUB_ETAG_TIMEOUT"
"""Seconds a metadata call may wait for the hub's answer (``huggingface_hub``'s own name)."""
ENV_STALL_TIMEOUT: Final = "HF_HUB_DOWNLOAD_TIMEOUT"
"""Seconds a download may go without receiving a byte (``huggingface_hub``'s own name)."""
CONNECT_TIMEOUT_SECONDS: Final = 10.0
REQUEST_TIMEOUT_SECONDS: Final = 30.0
STALL_TIMEOUT_SECONDS: Final = 60.0
_COMMIT: Final = re.compile(r"[0-9a-f]{40}")
_RESOLVE_PATH: Final = "/resolve/"
"""In a hub URL: a file download (everything else is metadata)."""


class HubStalledError(ModelLoadError):
    """The hub sent nothing for longer than the caller allows; raised inside a request, so the
    library's retries (which would wait minutes more) never run."""


@dataclasses.dataclass(frozen=True)
class HubTimeouts:
    """How long any hub call may wait (see the module docstring)."""

    connect_seconds: float = CONNECT_TIMEOUT_SECONDS
    request_seconds: float = REQUEST_TIMEOUT_SECONDS
    """A metadata call (repository info, a file's HEAD): the whole answer, retries included."""
    stall_seconds: float = STALL_TIMEOUT_SECONDS
    """A download: the longest time without a byte, retries included; its total time is unbounded
    while bytes keep coming."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> HubTimeouts:
        def seconds(name: str, default: float) -> float:
            raw = environ.get(name, "").strip()
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                raise ModelLoadError(f"{name}={raw[:32]!r} is not a number of seconds") from None
            if not math.isfinite(value) or value <= 0:
                raise ModelLoadError(f"{name}={raw[:32]!r} must be a positive number of seconds")
            return value

        request = seconds(ENV_REQUEST_TIMEOUT, REQUEST_TIMEOUT_SECONDS)
        return cls(
            connect_seconds=min(CONNECT_TIMEOUT_SECONDS, request),
            request_seconds=request,
            stall_seconds=seconds(ENV_STALL_TIMEOUT, STALL_TIMEOUT_SECONDS),
        )


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
    timeouts: HubTimeouts = HubTimeouts()

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise ModelLoadError(f"{ENV_HUB_ENDPOINT}={self.endpoint!r} is not an http:// or https:// URL")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HubSettings:
        env = os.environ if environ is None else environ
        endpoint = (env.get(ENV_HUB_ENDPOINT) or DEFAULT_ENDPOINT).rstrip("/")
        token = env.get(ENV_HUB_TOKEN) or None
        source = env.get(ENV_HUB_TOKEN_SOURCE) or ""
        return cls(endpoint=endpoint, token=token, token_source=source, timeouts=HubTimeouts.from_env(env))

    def describe_token(self) -> str:
        if self.token is None:
            return f"no token was sent ({ENV_HUB_TOKEN} is not set; set spec.model.hubTokenSecretRef)"
        where = f" from {self.token_source}" if self.token_source else ""
        return f"the hub refused the token in {ENV_HUB_TOKEN}{where}"


def download_hf_model(
    *,
    uri: str,
    repo_id: str,
    revision: str,
    cache_root: Path,
    hub: HubSettings,
    weights: bool = True,
) -> Path:
    """Fetch the runtime's files of ``repo_id`` at ``revision`` (empty: ``main``) into
    ``cache_root`` and return the snapshot directory. ``weights=False`` fetches the config and
    tokenizer only (what the router reads)."""
    revision = _checked_revision(revision, uri=uri)
    prefix = f"model {uri!r} is not in the local cache {cache_root} and could not be downloaded from {hub.endpoint}"
    try:
        with _bounded(hub):
            return _download(repo_id=repo_id, revision=revision, cache_root=cache_root, hub=hub, weights=weights)
    except ModelLoadError as error:
        raise ModelLoadError(f"{prefix}: {error}") from error
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear message
        raise ModelLoadError(
            f"{prefix}: {_explain(error, repo_id=repo_id, revision=revision, hub=hub, cache_root=cache_root)}"
        ) from error


def download_hf_file(
    *, uri: str, repo_id: str, filename: str, revision: str, cache_root: Path, hub: HubSettings
) -> Path:
    """Fetch one file (a ``.gguf`` model) of ``repo_id`` at ``revision`` into ``cache_root``'s
    hub layout; returns its path in the snapshot. Failures as :func:`download_hf_model`'s."""
    revision = _checked_revision(revision, uri=uri)
    prefix = f"model {uri!r} is not in the local cache {cache_root} and could not be downloaded from {hub.endpoint}"
    try:
        with _bounded(hub):
            return _download_file(repo_id=repo_id, filename=filename, revision=revision, cache_root=cache_root, hub=hub)
    except ModelLoadError as error:
        raise ModelLoadError(f"{prefix}: {error}") from error
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear message
        raise ModelLoadError(
            f"{prefix}: {_explain(error, repo_id=repo_id, revision=revision, hub=hub, cache_root=cache_root)}"
        ) from error


def _checked_revision(revision: str, *, uri: str) -> str:
    """``revision`` (empty: ``main``) once the contract's rule accepts it: it becomes a URL
    part and a file name under ``refs/``."""
    problem = revision_problem(revision)
    if problem is not None:
        raise ModelLoadError(f"model {uri!r}: {problem}")
    return revision or "main"


def _model_info(*, repo_id: str, revision: str, hub: HubSettings) -> Any:
    """The repository's file list at ``revision``, within the request bound."""
    from huggingface_hub import HfApi

    log.info(
        "asking the hub at %s for %s@%s (answer expected within %.0f s)",
        hub.endpoint,
        repo_id,
        revision,
        hub.timeouts.request_seconds,
    )
    _WATCH.start_call()
    return HfApi(endpoint=hub.endpoint, token=hub.token or False).model_info(
        repo_id, revision=revision, files_metadata=True, timeout=hub.timeouts.request_seconds
    )


def _commit_of(info: Any, *, repo_id: str, revision: str) -> str:
    """The commit the hub resolved ``revision`` to: a 40-digit hex hash, since it becomes a
    directory name in the cache (what the hub sent is not repeated: it may be anything)."""
    commit = info.sha
    if not commit:
        raise ModelLoadError(f"the hub named no commit for {repo_id}@{revision}")
    if not isinstance(commit, str) or _COMMIT.fullmatch(commit) is None:
        raise ModelLoadError(f"the hub named a commit for {repo_id}@{revision} that is not a 40-digit hex hash")
    return commit


def _download_file(*, repo_id: str, filename: str, revision: str, cache_root: Path, hub: HubSettings) -> Path:
    started = time.monotonic()
    info = _model_info(repo_id=repo_id, revision=revision, hub=hub)
    commit = _commit_of(info, repo_id=repo_id, revision=revision)
    names = sorted(s.rfilename for s in info.siblings or [])
    if filename not in names:
        ggufs = [n for n in names if n.endswith(".gguf")]
        raise ModelLoadError(
            f"{repo_id}@{revision} (commit {commit}) has no file {filename!r} "
            f"(GGUF files: {', '.join(ggufs) or 'none'})"
        )
    log.info(
        "downloading %s from %s@%s (commit %s) at %s into %s",
        filename,
        repo_id,
        revision,
        commit,
        hub.endpoint,
        cache_root,
    )
    cache_root.mkdir(parents=True, exist_ok=True)
    size = _fetch_file(repo_id=repo_id, filename=filename, commit=commit, cache_root=cache_root, hub=hub)
    repo_dir = cache_root / ("models--" + repo_id.replace("/", "--"))
    if revision != commit:
        _write_ref(repo_dir / "refs" / revision, commit)
    log.info("downloaded %s: %d bytes in %.2f s", filename, size, time.monotonic() - started)
    return repo_dir / "snapshots" / commit / filename


def _download(*, repo_id: str, revision: str, cache_root: Path, hub: HubSettings, weights: bool) -> Path:
    started = time.monotonic()
    info = _model_info(repo_id=repo_id, revision=revision, hub=hub)
    commit = _commit_of(info, repo_id=repo_id, revision=revision)
    siblings = {s.rfilename: s.size for s in info.siblings or []}
    files = sorted(name for name in siblings if wanted(name))
    skipped = sorted(name for name in siblings if not wanted(name))
    if CONFIG_FILE not in files:
        raise ModelLoadError(f"{repo_id}@{revision} (commit {commit}) has no {CONFIG_FILE}")
    if not any(name.endswith(".safetensors") for name in files):
        raise ModelLoadError(
            f"{repo_id}@{revision} (commit {commit}) has no *.safetensors weights "
            f"(files: {', '.join(sorted(siblings)) or 'none'}); this runtime loads safetensors only"
        )
    if not weights:
        files = [name for name in files if not name.endswith(WEIGHT_SUFFIXES)]
    planned = sum(siblings[name] or 0 for name in files)
    log.info(
        "downloading %s@%s (commit %s) from %s into %s: %d files, %s%s",
        repo_id,
        revision,
        commit,
        hub.endpoint,
        cache_root,
        len(files),
        _size(planned),
        f"; not fetched: {', '.join(skipped)}" if skipped else "",
    )
    cache_root.mkdir(parents=True, exist_ok=True)
    rest = [name for name in files if name != CONFIG_FILE]
    total = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(rest) or 1)) as pool:
        futures = {
            pool.submit(
                _fetch_file, repo_id=repo_id, filename=name, commit=commit, cache_root=cache_root, hub=hub
            ): name
            for name in rest
        }
        for future in concurrent.futures.as_completed(futures):
            total += future.result()
    total += _fetch_file(repo_id=repo_id, filename=CONFIG_FILE, commit=commit, cache_root=cache_root, hub=hub)
    repo_dir = cache_root / ("models--" + repo_id.replace("/", "--"))
    if revision != commit:
        _write_ref(repo_dir / "refs" / revision, commit)
    seconds = time.monotonic() - started
    log.info(
        "downloaded %s@%s (commit %s): %d files, %d bytes in %.2f s (%s/s)",
        repo_id,
        revision,
        commit,
        len(files),
        total,
        seconds,
        _size(total / max(seconds, 1e-6)),
    )
    return repo_dir / "snapshots" / commit


def _fetch_file(*, repo_id: str, filename: str, commit: str, cache_root: Path, hub: HubSettings) -> int:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils.tqdm import silent_tqdm

    started = time.monotonic()
    log.info(
        "fetching %s from %s (giving up after %.0f s without data)", filename, hub.endpoint, hub.timeouts.stall_seconds
    )
    _WATCH.start_call()
    path = Path(
        hf_hub_download(
            repo_id,
            filename,
            revision=commit,
            cache_dir=cache_root,
            endpoint=hub.endpoint,
            token=hub.token or False,
            etag_timeout=hub.timeouts.request_seconds,
            tqdm_class=silent_tqdm,  # no progress bars in pod logs
        )
    )
    size = path.stat().st_size
    log.info("fetched %s (%s, %d bytes) in %.2f s", filename, _size(size), size, time.monotonic() - started)
    return size


class _Watch:
    """The bounds of the hub calls in progress, read by the transport of the one
    ``huggingface_hub`` session: the current :class:`HubTimeouts`, and per thread (each
    download runs on its own) when data last arrived for the request being retried.

    A request that repeats the previous one of its thread (same method and URL: the library's
    retry, or a resumed download) is refused once nothing has arrived for longer than the
    stall bound since that request was first sent. Any other request starts a fresh clock: the
    library sends requests of its own (user-agent lookups) whose silence is not the
    download's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.timeouts = HubTimeouts()
        self.endpoint = ""
        self._active = 0
        self._threads = threading.local()

    def begin(self, hub: HubSettings) -> None:
        with self._lock:
            self.timeouts = hub.timeouts
            self.endpoint = hub.endpoint
            self._active += 1

    def end(self) -> None:
        with self._lock:
            self._active -= 1

    def progress(self) -> None:
        """Data arrived for this thread's request."""
        self._threads.last_progress = time.monotonic()

    def start_call(self) -> None:
        """This thread begins a library call: nothing before it counts as a retry."""
        self._threads.request = None

    def check(self, method: str, url: str) -> None:
        """Before each request (the library's retries included): refuse to go on once the
        request being retried has gone without data for longer than the stall bound."""
        threads = self._threads
        request = (method, url)
        if getattr(threads, "request", None) != request:
            threads.request = request
            threads.last_progress = time.monotonic()
            return
        silent = time.monotonic() - threads.last_progress
        if self._active and silent > self.timeouts.stall_seconds:
            threads.request = None
            raise HubStalledError(
                f"the hub endpoint {self.endpoint or url} sent nothing for {silent:.0f} s "
                f"(limit {self.timeouts.stall_seconds:g} s, {ENV_STALL_TIMEOUT}); check "
                f"{ENV_HUB_ENDPOINT} (spec.model.hubEndpoint)"
            )


_WATCH: Final = _Watch()
_INSTALL_LOCK: Final = threading.Lock()
_installed = False


@contextlib.contextmanager
def _bounded(hub: HubSettings) -> Iterator[None]:
    """Every ``huggingface_hub`` request inside is bounded by ``hub.timeouts`` (the library's
    one shared session gets :func:`_bounded_transport` the first time)."""
    global _installed
    import huggingface_hub.constants
    from huggingface_hub import set_client_factory

    with _INSTALL_LOCK:
        if not _installed:
            set_client_factory(_bounded_client)
            _installed = True
    # the library's download GET reads this module constant on each call
    huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT = max(1, math.ceil(hub.timeouts.stall_seconds))
    # httpx2 logs every request at INFO; the pod log gets one line per file from us instead.
    logging.getLogger("httpx2").setLevel(max(logging.getLogger("httpx2").getEffectiveLevel(), logging.WARNING))
    _WATCH.begin(hub)
    try:
        yield
    finally:
        _WATCH.end()


def _bounded_client() -> httpx2.Client:
    """``huggingface_hub``'s default client (its request hook, redirects) over the bounded
    transport."""
    import httpx2
    from huggingface_hub.utils._http import hf_request_event_hook

    return httpx2.Client(
        event_hooks={"request": [hf_request_event_hook]},
        follow_redirects=True,
        timeout=None,
        transport=_bounded_transport(httpx2.HTTPTransport(), watch=_WATCH),
    )


def _capped(timeouts: Mapping[str, Any], *, connect: float, read: float) -> dict[str, float]:
    """A request's timeouts with each one no longer than the cap (None, "no limit", too)."""
    caps = {"connect": connect, "read": read, "write": read, "pool": read}
    out: dict[str, float] = {}
    for key, cap in caps.items():
        value = timeouts.get(key)
        out[key] = cap if value is None else min(float(value), cap)
    return out


def _bounded_transport(inner: httpx2.BaseTransport, *, watch: _Watch) -> httpx2.BaseTransport:
    """A transport over ``inner`` that caps each request's timeouts (metadata:
    ``request_seconds``; a file download's reads: ``stall_seconds``), refuses a request once
    the hub has been silent past the stall bound, and counts every received chunk as progress.
    Built here, not at import: ``httpx2`` comes with ``huggingface_hub``, needed only to
    download."""
    import httpx2

    class ProgressStream(httpx2.SyncByteStream):
        def __init__(self, body: httpx2.SyncByteStream) -> None:
            self._body = body

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._body:
                watch.progress()
                yield chunk

        def close(self) -> None:
            self._body.close()

    class BoundedTransport(httpx2.BaseTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            watch.check(request.method, str(request.url))
            timeouts = watch.timeouts
            download = request.method == "GET" and _RESOLVE_PATH in request.url.path
            read = timeouts.stall_seconds if download else timeouts.request_seconds
            request.extensions["timeout"] = _capped(
                request.extensions.get("timeout") or {}, connect=timeouts.connect_seconds, read=read
            )
            response = inner.handle_request(request)
            watch.progress()
            assert isinstance(response.stream, httpx2.SyncByteStream)
            response.stream = ProgressStream(response.stream)
            return response

        def close(self) -> None:
            inner.close()

    return BoundedTransport()


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

    if (cause := find(httpx2.TimeoutException)) is not None and not isinstance(cause, httpx2.ConnectTimeout):
        return (
            f"the hub endpoint {hub.endpoint} accepted the connection but did not answer in time "
            f"({type(cause).__name__}; limits: {hub.timeouts.request_seconds:g} s for metadata, "
            f"{hub.timeouts.stall_seconds:g} s without data for a download: {ENV_REQUEST_TIMEOUT}, "
            f"{ENV_STALL_TIMEOUT}); check {ENV_HUB_ENDPOINT} (spec.model.hubEndpoint)"
        )
    if (cause := find(httpx2.ConnectError, httpx2.TimeoutException)) is not None:
        return (
            f"the hub endpoint {hub.endpoint} is unreachable ({type(cause).__name__}: "
            f"{_first_line(cause)}); check {ENV_HUB_ENDPOINT} (spec.model.hubEndpoint)"
        )
    if find(RevisionNotFoundError) is not None:
        return f"HTTP 404: repository {repo_id} has no revision {revision!r}"
    if (cause := find(RemoteEntryNotFoundError)) is not None:
        return f"HTTP 404: a file of {repo_id}@{revision} is missing on the hub ({_first_line(cause)})"
    if (cause := find(GatedRepoError)) is not None:
        return (
            f"HTTP {_status(cause)}: {repo_id} is gated and {hub.describe_token()} "
            "(accept the model's terms with the token's account)"
        )
    if (cause := find(RepositoryNotFoundError)) is not None:
        status = _status(cause)
        if status in (401, 403):
            return (
                f"HTTP {status}: no repository {repo_id} is visible: {hub.describe_token()}, "
                "or the repository does not exist"
            )
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
