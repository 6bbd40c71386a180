"""Kubeconfig files for the local cluster.

One writer for every kubeconfig the harness hands out: the admin's (client certificate in
``system:masters``), the controllers' (their own identities, so RBAC applies to them as in a
real cluster) and the per-ServiceAccount ones built from TokenRequest tokens, which make RBAC of
that ServiceAccount apply to whoever uses the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONTEXT_NAME = "splitserve-e2e"


def _document(
    *, server: str, ca_cert: Path, user: dict[str, Any], user_name: str, namespace: str | None
) -> dict[str, Any]:
    context: dict[str, Any] = {"cluster": CONTEXT_NAME, "user": user_name}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT_NAME, "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": CONTEXT_NAME, "context": context}],
        "current-context": CONTEXT_NAME,
        "preferences": {},
    }


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(document, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def write_cert_kubeconfig(
    *, path: Path, server: str, ca_cert: Path, client_cert: Path, client_key: Path, user_name: str
) -> Path:
    """A kubeconfig that authenticates with a client certificate."""
    user = {"client-certificate": str(client_cert), "client-key": str(client_key)}
    return _write(path, _document(server=server, ca_cert=ca_cert, user=user, user_name=user_name, namespace=None))


def write_token_kubeconfig(
    *, path: Path, server: str, ca_cert: Path, token: str, user_name: str, namespace: str | None
) -> Path:
    """A kubeconfig that authenticates with a bearer token (a ServiceAccount's)."""
    return _write(
        path, _document(server=server, ca_cert=ca_cert, user={"token": token}, user_name=user_name, namespace=namespace)
    )


def server_of(*, kubeconfig: Path) -> str:
    """The API server URL of the current context of ``kubeconfig``."""
    document = yaml.safe_load(kubeconfig.read_text())
    context_name = document.get("current-context")
    context = next(c["context"] for c in document["contexts"] if c["name"] == context_name)
    cluster = next(c["cluster"] for c in document["clusters"] if c["name"] == context["cluster"])
    return str(cluster["server"])
