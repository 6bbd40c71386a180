"""The per-InferenceService KV handoff key: a Secret the operator creates once and never reads.

A decode pod must accept ``kv_transfer_params`` only from its own prefill pods, or any client
could make it connect anywhere (docs/architecture.md, "Prefill → decode handoff"). Prefill
pods sign the parameters and decode pods verify them with one random key per
InferenceService, held in Secret ``<isvc>-kv-handoff`` (data key ``key``: 32 random bytes)
and mounted read-only into the prefill and decode pods at
:data:`~splitserve_contract.HANDOFF_KEY_MOUNT_DIR` (:mod:`.render` passes the file with
``--handoff-key-file``). Router and aggregated pods neither sign nor verify and do not mount it,
except that every pod of a multi-node pool (aggregated too) mounts it as the secret its
group's rendezvous key is derived from (``--rendezvous-key-file``, :mod:`.leader_worker_set`).

Created, never applied, never read. Every reconcile of a disaggregated InferenceService
that does not already see the Secret as its own POSTs it: a server-side apply would send new
random bytes on every reconcile (rotating the key under running pods), and avoiding that would
mean reading the Secret's data. A POST answered 409 AlreadyExists is not taken as "it is
there": the name may be held by a Secret someone else planted before the InferenceService
existed, which would fix the key its pods trust. So the 409 is followed by a metadata-only
list of that one name (``PartialObjectMetadata``: no data is sent), and a Secret whose
controlling owner is not this InferenceService (by UID) is a :class:`~.apply.NameConflict`:
left untouched, and the pools that would mount it are not applied (:mod:`.dependencies`). The
operator needs ``create``, ``list`` and ``watch`` on Secrets and asks for no Secret's data
(the chart's RBAC); the watch (:mod:`.secret_watch`) is what re-creates a deleted Secret at once
and lets a reconcile skip the POST when the Secret is seen as its own.

The Secret carries the InferenceService as controlling owner (garbage-collected with it) and
the instance labels of its other children. A Secret deleted by hand is re-created, with a
new key, as soon as its deletion is seen; pods that already run keep the key they loaded, so
restart the pools after doing that.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Final

import splitserve_contract as contract

from . import apply, child_cache, kube, naming

KEY_BYTES: Final = 32
KEY_FILE: Final = f"{contract.HANDOFF_KEY_MOUNT_DIR}/{contract.HANDOFF_KEY_SECRET_KEY}"
"""Where prefill and decode pods find the key (``--handoff-key-file``)."""
VOLUME_NAME: Final = "kv-handoff"
FILE_MODE: Final = 0o440
"""Owner and group read: the pods run as a non-root user whose fsGroup owns the file."""


def secret(*, isvc_name: str, namespace: str, owner_reference: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """The Secret object holding ``key`` (pure; the caller draws the key)."""
    labels = {**naming.instance_selector_labels(isvc_name), contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": naming.handoff_key_secret_name(isvc_name),
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [dict(owner_reference)],
        },
        "type": "Opaque",
        "immutable": True,
        "data": {contract.HANDOFF_KEY_SECRET_KEY: base64.b64encode(key).decode("ascii")},
    }


def volume(isvc_name: str) -> dict[str, Any]:
    """The pod volume of the Secret."""
    return {
        "name": VOLUME_NAME,
        "secret": {"secretName": naming.handoff_key_secret_name(isvc_name), "defaultMode": FILE_MODE},
    }


def volume_mount() -> dict[str, Any]:
    """The container's read-only mount of :func:`volume`."""
    return {"name": VOLUME_NAME, "mountPath": contract.HANDOFF_KEY_MOUNT_DIR, "readOnly": True}


def as_secret(metadata_only: Mapping[str, Any]) -> dict[str, Any]:
    """A ``PartialObjectMetadata`` of a Secret, named as the Secret it describes (for the child cache)."""
    return {**metadata_only, "apiVersion": kube.SECRET.api_version, "kind": kube.SECRET.kind}


def ensure(
    *,
    api: kube.KubeAPI,
    isvc_name: str,
    namespace: str,
    owner_reference: Mapping[str, Any],
    cache: child_cache.ChildCache | None = None,
    random_bytes: Callable[[int], bytes] = secrets.token_bytes,
) -> bool:
    """Create the Secret unless this InferenceService's own is there (see the module
    docstring). True when this call created it. Raises :class:`~.apply.NameConflict` when the
    name is held by a Secret this InferenceService does not control, and the API error of a
    failed create or ownership check."""
    name = naming.handoff_key_secret_name(isvc_name)
    owner_uid = str(owner_reference["uid"])
    key = (kube.SECRET.api_version, kube.SECRET.kind, namespace, name)
    seen = cache.seen(key) if cache is not None else None
    if seen is not None and seen.controller_uid == owner_uid:
        return False  # the watch shows ours: nothing to send
    obj = secret(isvc_name=isvc_name, namespace=namespace, owner_reference=owner_reference, key=random_bytes(KEY_BYTES))
    last: kube.ApiException | None = None
    for _ in range(2):  # a Secret deleted between our create and our look gets one more create
        try:
            created = api.create(
                kind=kube.SECRET, namespace=namespace, obj=obj, field_manager=contract.FIELD_MANAGER_RECONCILER
            )
        except kube.ApiException as exc:
            if not kube.is_conflict(exc):
                raise
            last = exc
        else:
            if cache is not None:  # its watch event is the echo of this write
                cache.record(key, digest="", result=created)
            return True
        found, _rv = api.list_metadata(kind=kube.SECRET, namespace=namespace, field_selector=f"metadata.name={name}")
        live = next((as_secret(o) for o in found if (o.get("metadata") or {}).get("name") == name), None)
        if live is None:
            continue
        if cache is not None:
            cache.observe(live)
        if child_cache.controller_uid(live) == owner_uid:
            return False  # created earlier: keep its key
        ref = apply.controller_of(live)
        raise apply.NameConflict(
            kind=kube.SECRET.kind, name=name, owner=f"{ref.get('kind')}/{ref.get('name')}" if ref else None
        )
    assert last is not None
    raise last
