"""The per-InferenceService KV handoff key: a Secret the operator creates once and never reads.

A decode pod must accept ``kv_transfer_params`` only from its own prefill pods, or any client
could make it connect anywhere (docs/architecture.md, "Prefill → decode handoff"). Prefill
pods sign the parameters and decode pods verify them with one random key per
InferenceService, held in Secret ``<isvc>-kv-handoff`` (data key ``key``: 32 random bytes)
and mounted read-only into the prefill and decode pods at
:data:`~splitserve_contract.HANDOFF_KEY_MOUNT_DIR` (:mod:`.render` passes the file with
``--handoff-key-file``). Router and aggregated pods neither sign nor verify and do not mount it.

Created, never applied. Every reconcile of a disaggregated InferenceService POSTs the Secret
and takes 409 AlreadyExists as "it is there": a server-side apply would send new random bytes
on every reconcile (rotating the key under running pods), and avoiding that would mean
reading the Secret first. A POST that loses to an existing object changes nothing, so the
operator needs ``create`` on Secrets and nothing else: it never reads one (the chart's RBAC).

The Secret carries the InferenceService as controlling owner (garbage-collected with it) and
the instance labels of its other children. A Secret deleted by hand is re-created, with a
new key, by the next reconcile; pods that already run keep the key they loaded, so restart
the pools after doing that.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Final

from kubernetes.client.exceptions import ApiException

import splitserve_contract as contract

from . import kube, naming

KEY_BYTES: Final = 32
KEY_FILE: Final = f"{contract.HANDOFF_KEY_MOUNT_DIR}/{contract.HANDOFF_KEY_SECRET_KEY}"
"""Where prefill and decode pods find the key (``--handoff-key-file``)."""
VOLUME_NAME: Final = "kv-handoff"
FILE_MODE: Final = 0o440
"""Owner and group read: the pods run as a non-root user whose fsGroup owns the file."""


def secret(*, isvc_name: str, namespace: str, owner_reference: Mapping[str, Any], key: bytes) -> dict[str, Any]:
    """The Secret object holding ``key`` (pure; the caller draws the key)."""
    labels = {**naming.instance_selector_labels(isvc_name),
              contract.LABEL_MANAGED_BY: contract.MANAGED_BY_VALUE}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": naming.handoff_key_secret_name(isvc_name), "namespace": namespace,
                     "labels": labels, "ownerReferences": [dict(owner_reference)]},
        "type": "Opaque",
        "immutable": True,
        "data": {contract.HANDOFF_KEY_SECRET_KEY: base64.b64encode(key).decode("ascii")},
    }


def volume(isvc_name: str) -> dict[str, Any]:
    """The pod volume of the Secret."""
    return {"name": VOLUME_NAME, "secret": {
        "secretName": naming.handoff_key_secret_name(isvc_name), "defaultMode": FILE_MODE}}


def volume_mount() -> dict[str, Any]:
    """The container's read-only mount of :func:`volume`."""
    return {"name": VOLUME_NAME, "mountPath": contract.HANDOFF_KEY_MOUNT_DIR, "readOnly": True}


def ensure(*, api: kube.KubeAPI, isvc_name: str, namespace: str, owner_reference: Mapping[str, Any],
           random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> bool:
    """Create the Secret unless it exists (see the module docstring). True when this call
    created it; raises the API error of a failed create other than AlreadyExists."""
    obj = secret(isvc_name=isvc_name, namespace=namespace, owner_reference=owner_reference,
                 key=random_bytes(KEY_BYTES))
    try:
        api.create(kind=kube.SECRET, namespace=namespace, obj=obj,
                   field_manager=contract.FIELD_MANAGER_RECONCILER)
    except ApiException as exc:
        if kube.is_conflict(exc):  # 409 AlreadyExists: created earlier, keep its key
            return False
        raise
    return True
