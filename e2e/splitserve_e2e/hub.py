"""A Hugging Face hub-compatible HTTP server on loopback: a model hub for tests and the demo.

Why: the runtime downloads ``hf://`` models with the real ``huggingface_hub`` client
(``HF_ENDPOINT``), and tests must exercise that client, the pods' env and the operator's
Secret wiring without the internet. A real mirror server was considered first: ``olah`` can
serve local git repositories offline, but in offline mode it never checks the token (the
``Authorization`` header is only forwarded upstream), so a refused token (HTTP 401) cannot be
tested, and it needs its own venv (it pins fastapi/pydantic versions this project does not
use). This module is the small part of the hub protocol ``huggingface_hub`` 2.x uses to
download a model, on the standard library's ``ThreadingHTTPServer``:

- ``GET /api/models/{org}/{name}[/revision/{rev}]``: model info: ``sha`` (the commit the
  revision names) and ``siblings`` (``rfilename``, ``size``, ``blobId``);
- ``GET /api/models/{org}/{name}/tree/{rev}[/{path}]``: the file listing ``snapshot_download``
  reads;
- ``HEAD``/``GET /{org}/{name}/resolve/{rev}/{path}``: the file, with the headers the client
  requires: ``X-Repo-Commit``, ``ETag`` (the git blob id), ``Content-Length``; ``Range``
  requests (resumed downloads) get ``206``.

Errors carry the ``X-Error-Code`` the client maps to its exceptions: unknown repository 404
``RepoNotFound``, unknown revision 404 ``RevisionNotFound``, unknown file 404
``EntryNotFound``. With a ``token``, every request must send ``Authorization: Bearer <token>``:
no header is answered 401 ``RepoNotFound`` (what the real hub says for a private repository),
a wrong token 401 "Invalid credentials in Authorization header".

Repositories live on disk under ``root`` so another process can serve them too
(``python -m splitserve_e2e.hub ROOT``)::

    ROOT/org/name/commits/<commit>/<files>
    ROOT/org/name/refs/heads/<branch>      (the commit id)
    ROOT/org/name/refs/tags/<tag>

:meth:`LocalHub.publish` adds a commit from a directory. :attr:`LocalHub.requests` records
every request (method, path) so tests can assert what was (not) downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import http.server
import json
import re
import shutil
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

_REPO_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT: Final = re.compile(r"^[0-9a-f]{40}$")
INVALID_CREDENTIALS: Final = "Invalid credentials in Authorization header"
CHUNK_BYTES: Final = 64 * 1024
AGENT_REGISTRY_PATH: Final = "/api/agent-harnesses"
_EMPTY_AGENT_REGISTRY: Final[dict[str, Any]] = {"standardEnvVars": [], "harnesses": {}}


def git_blob_id(data: bytes) -> str:
    """The id git (and the hub) give a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class HubError(Exception):
    """An HTTP error answer: status, ``X-Error-Code`` and message."""

    def __init__(self, status: int, code: str, message: str, *, commit: str = "") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One request the hub answered, with when it started and finished (``time.monotonic``)."""

    method: str
    path: str
    status: int
    started: float
    finished: float


class HubStore:
    """The repositories under ``root`` (see the module docstring for the layout)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def repo_dir(self, repo_id: str) -> Path:
        if not _REPO_ID.match(repo_id):
            raise ValueError(f"repository id {repo_id!r} is not org/name")
        return self.root / repo_id

    def publish(
        self,
        repo_id: str,
        source: Path,
        *,
        branch: str = "main",
        tags: Sequence[str] = (),
        extra_files: Mapping[str, bytes] | None = None,
        exclude: Iterable[str] = (),
    ) -> str:
        """Commit every file under ``source`` (plus ``extra_files``, minus ``exclude``) to
        ``branch`` of ``repo_id``; returns the commit id. Same parent and content: same id."""
        repo = self.repo_dir(repo_id)
        skip = set(exclude)
        files: dict[str, bytes] = {
            p.relative_to(source).as_posix(): p.read_bytes()
            for p in sorted(source.rglob("*"))
            if p.is_file() and p.relative_to(source).as_posix() not in skip
        }
        files.update(extra_files or {})
        if not files:
            raise ValueError(f"nothing to publish from {source}")
        parent = self._ref(repo, "heads", branch) or ""
        digest = hashlib.sha1(f"parent {parent}\n".encode(), usedforsecurity=False)
        for name in sorted(files):
            digest.update(f"{name} {git_blob_id(files[name])}\n".encode())
        commit = digest.hexdigest()
        target = repo / "commits" / commit
        if not target.is_dir():
            staging = repo / "commits" / f".{commit}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            for name, data in files.items():
                path = staging / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            staging.rename(target)
        for kind, name in (("heads", branch), *(("tags", t) for t in tags)):
            ref = repo / "refs" / kind / name
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit, encoding="utf-8")
        return commit

    @staticmethod
    def _ref(repo: Path, kind: str, name: str) -> str | None:
        path = repo / "refs" / kind / name
        if ".." in Path(name).parts or not path.is_file():
            return None
        return path.read_text(encoding="utf-8").strip()

    def resolve(self, repo_id: str, revision: str) -> tuple[str, Path]:
        """(commit, commit directory) of ``revision``: a commit id, branch or tag."""
        if not _REPO_ID.match(repo_id) or not (self.root / repo_id / "commits").is_dir():
            raise HubError(404, "RepoNotFound", "Repository not found")
        repo = self.root / repo_id
        commit = (
            revision
            if _COMMIT.match(revision)
            else (self._ref(repo, "heads", revision) or self._ref(repo, "tags", revision))
        )
        if commit is None or not (repo / "commits" / commit).is_dir():
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit, repo / "commits" / commit

    def files(self, commit_dir: Path) -> list[Path]:
        return sorted(p for p in commit_dir.rglob("*") if p.is_file())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HubHTTPServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(head=True)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass

    def _serve(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        status = 500
        started = time.monotonic()
        try:
            if url.path == AGENT_REGISTRY_PATH:  # huggingface_hub asks for it, token or not
                self._send(
                    200, json.dumps(_EMPTY_AGENT_REGISTRY).encode(), {"Content-Type": "application/json"}, head=head
                )
                status = 200
                return
            self._check_token()
            status = self._route(url.path, parse_qs(url.query), head=head)
        except HubError as error:
            status = error.status
            body = json.dumps({"error": error.message}).encode()
            headers = {"X-Error-Code": error.code, "X-Error-Message": error.message, "Content-Type": "application/json"}
            if error.commit:
                headers["X-Repo-Commit"] = error.commit
            self._send(status, body, headers, head=head)
        finally:
            self.server.record(RequestRecord(self.command, url.path, status, started, time.monotonic()))

    def _check_token(self) -> None:
        expected = self.server.token
        if expected is None:
            return
        sent = self.headers.get("Authorization")
        if sent is None:
            raise HubError(401, "RepoNotFound", "Repository not found")
        if sent != f"Bearer {expected}":
            raise HubError(401, "", INVALID_CREDENTIALS)

    def _route(self, path: str, query: Mapping[str, list[str]], *, head: bool) -> int:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        store = self.server.store
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            rest = parts[4:]
            if not rest or (rest[0] == "revision" and len(rest) == 2):
                return self._model_info(repo_id, rest[1] if rest else "main", head=head)
            if rest[0] == "tree" and len(rest) >= 2:
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                return self._tree(repo_id, rest[1], "/".join(rest[2:]), recursive=recursive, head=head)
        if len(parts) >= 5 and parts[2] == "resolve":
            commit, commit_dir = store.resolve("/".join(parts[:2]), parts[3])
            return self._file(commit, commit_dir, "/".join(parts[4:]), head=head)
        raise HubError(404, "", f"no such endpoint: {path}")

    def _model_info(self, repo_id: str, revision: str, *, head: bool) -> int:
        commit, commit_dir = self.server.store.resolve(repo_id, revision)
        siblings = []
        for path in self.server.store.files(commit_dir):
            data = path.read_bytes()
            siblings.append(
                {"rfilename": path.relative_to(commit_dir).as_posix(), "size": len(data), "blobId": git_blob_id(data)}
            )
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": self.server.token is not None,
            "gated": False,
            "disabled": False,
            "siblings": siblings,
        }
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head=head)
        return 200

    def _tree(self, repo_id: str, revision: str, sub: str, *, recursive: bool, head: bool) -> int:
        _, commit_dir = self.server.store.resolve(repo_id, revision)
        base = commit_dir / sub if sub else commit_dir
        if ".." in Path(sub).parts or not base.is_dir():
            raise HubError(404, "EntryNotFound", f"{sub} does not exist")
        entries: list[dict[str, Any]] = []
        for path in sorted(base.rglob("*") if recursive else base.iterdir()):
            rel = path.relative_to(commit_dir).as_posix()
            if path.is_dir():
                entries.append({"type": "directory", "oid": git_blob_id(rel.encode()), "size": 0, "path": rel})
            else:
                data = path.read_bytes()
                entries.append({"type": "file", "oid": git_blob_id(data), "size": len(data), "path": rel})
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head=head)
        return 200

    def _file(self, commit: str, commit_dir: Path, name: str, *, head: bool) -> int:
        path = commit_dir / name
        if not name or ".." in Path(name).parts or not path.is_file():
            raise HubError(404, "EntryNotFound", f"{name} does not exist at {commit}", commit=commit)
        data = path.read_bytes()
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{git_blob_id(data)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status, body = 200, data
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if match and int(match.group(1)) < len(data):
            start = int(match.group(1))
            end = min(int(match.group(2)), len(data) - 1) if match.group(2) else len(data) - 1
            status, body = 206, data[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(status, body, headers, head=head)
        return status

    def _send(self, status: int, body: bytes, headers: Mapping[str, str], *, head: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        delay = self.server.chunk_delay_seconds
        if delay <= 0:
            self.wfile.write(body)
            return
        for start in range(0, len(body), CHUNK_BYTES):
            self.wfile.write(body[start : start + CHUNK_BYTES])
            self.wfile.flush()
            time.sleep(delay)


class _HubHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], *, store: HubStore, token: str | None, chunk_delay_seconds: float
    ) -> None:
        super().__init__(address, _Handler)
        self.store = store
        self.token = token
        self.chunk_delay_seconds = chunk_delay_seconds
        self._lock = threading.Lock()
        self.records: list[RequestRecord] = []

    def record(self, entry: RequestRecord) -> None:
        with self._lock:
            self.records.append(entry)


class LocalHub:
    """The hub on ``host:port`` (port 0: any free port) in a background thread. Use as a
    context manager; :attr:`endpoint` is what ``HF_ENDPOINT`` / ``spec.model.hubEndpoint``
    take. ``chunk_delay_seconds``: sleep after each 64 KiB of a file, so downloads take long
    enough for tests to overlap them."""

    def __init__(
        self,
        root: Path,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_delay_seconds: float = 0.0,
    ) -> None:
        self.store = HubStore(root)
        self._server = _HubHTTPServer(
            (host, port), store=self.store, token=token, chunk_delay_seconds=chunk_delay_seconds
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def requests(self) -> list[RequestRecord]:
        with self._server._lock:
            return list(self._server.records)

    def downloaded(self, repo_id: str) -> list[str]:
        """Files of ``repo_id`` whose content was sent (GET resolve answered 200/206)."""
        prefix = f"/{repo_id}/resolve/"
        return [
            unquote(r.path[len(prefix) :]).split("/", 1)[1]
            for r in self.requests
            if r.method == "GET" and r.status in (200, 206) and r.path.startswith(prefix)
        ]

    def publish(self, repo_id: str, source: Path, **kwargs: Any) -> str:
        return self.store.publish(repo_id, source, **kwargs)

    def start(self) -> LocalHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve_e2e.hub", description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="directory of repositories (org/name/commits, refs)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN'")
    parser.add_argument(
        "--publish",
        nargs=2,
        metavar=("REPO_ID", "DIR"),
        action="append",
        default=[],
        help="commit DIR to the main branch of REPO_ID first (repeatable)",
    )
    args = parser.parse_args(argv)
    hub = LocalHub(args.root, token=args.token, host=args.host, port=args.port)
    for repo_id, source in args.publish:
        print(f"{repo_id}: commit {hub.publish(repo_id, Path(source))}", flush=True)
    print(f"HF_ENDPOINT={hub.endpoint}", flush=True)
    try:
        hub._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        hub._server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
