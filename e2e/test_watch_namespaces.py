"""The chart's ``rbac.scope: namespaces``: one operator, installed in a namespace of its own by
Helm, with a Role and RoleBinding in each of two listed namespaces and no cluster-scoped object,
watching exactly those two. An InferenceService in either listed namespace is reconciled (its
children are created and its status written); one in a namespace that is not listed is never
touched, and the API server agrees the operator may do nothing there. The release keeps the
chart's default ``inferencePool.enabled: false``: an InferenceService asking for
``spec.router.mode: InferencePool`` is ``Stalled``/``InferencePoolDisabled`` and gets no
children, and the operator may not create ServiceAccounts, Roles or RoleBindings anywhere.

Pools run on kwok GPU nodes (nothing is downloaded); the routers' pods are not waited for: the
check is what the operator writes, not what serves.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_contract import Reason
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.kwok import KWOK_NODE_LABEL, KWOK_NODE_LABEL_VALUE, kwok_toleration
from splitserve_e2e.stack import (
    ISVC_PLURAL,
    MODEL_NAME,
    ModelHub,
    create_hub_token_secret,
    create_namespace,
    install_operator,
)
from splitserve_operator import api as isvc_api

pytestmark = pytest.mark.e2e

RELEASE = "ops-scoped"
FULLNAME = f"{RELEASE}-splitserve"
CONVERGE_SECONDS = 180.0
QUIET_SECONDS = 10.0
"""How long the unlisted namespace is watched for writes after both listed ones converged."""


@dataclass(frozen=True)
class Install:
    operator: str
    watched: tuple[str, str]
    unlisted: str


@pytest.fixture(scope="module")
def install(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[Install]:
    suffix = uuid.uuid4().hex[:5]
    found = Install(
        operator=f"e2e-scoped-ops-{suffix}",
        watched=(f"e2e-scoped-a-{suffix}", f"e2e-scoped-b-{suffix}"),
        unlisted=f"e2e-scoped-c-{suffix}",
    )
    namespaces = [found.operator, *found.watched, found.unlisted]
    try:
        for name in namespaces:
            create_namespace(cluster, name, restricted=True)
        for name in [*found.watched, found.unlisted]:
            create_hub_token_secret(cluster=cluster, namespace=name, hub=model_hub)
        install_operator(
            cluster=cluster,
            namespace=found.operator,
            image=image,
            release=RELEASE,
            with_prometheus=False,
            extra_args=("--set", "rbac.scope=namespaces", "--set", f"watchNamespaces={{{','.join(found.watched)}}}"),
        )
        yield found
    finally:
        for name in [*found.watched, found.unlisted]:
            cluster.kubectl(
                "delete", ISVC_PLURAL, "--all", "-n", name, "--timeout=60s", check=False, timeout_seconds=90
            )
        cluster.helm("uninstall", RELEASE, "-n", found.operator, check=False)
        for name in namespaces:
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _manifest(name: str, namespace: str, hub: ModelHub, **router: Any) -> dict[str, Any]:
    kwok = {"tolerations": [kwok_toleration()], "nodeSelector": {KWOK_NODE_LABEL: KWOK_NODE_LABEL_VALUE}}
    return {
        "apiVersion": isvc_api.API_VERSION_STRING,
        "kind": contract.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {
                "uri": f"hf://{MODEL_NAME}",
                "dtype": "float32",
                "hubEndpoint": hub.endpoint,
                "hubTokenSecretRef": {"name": hub.token_secret},
            },
            "mode": "Aggregated",
            "aggregated": {"replicas": {"min": 1, "max": 1}, "resources": {"gpus": 1}, **kwok},
            **({"router": router} if router else {}),
        },
    }


def _apply(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input_text=json.dumps(obj))


def _isvc(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", ISVC_PLURAL, name, "-n", namespace, "-o", "json").stdout))


def _children(cluster: LocalCluster, namespace: str, name: str) -> list[str]:
    result = cluster.kubectl(
        "get",
        "deployments,services,configmaps,networkpolicies,serviceaccounts,roles",
        "-n",
        namespace,
        "-l",
        f"{contract.LABEL_INSTANCE}={name}",
        "-o",
        "name",
    )
    return result.stdout.split()


def _stalled(obj: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Stalled"), {})


def _can(cluster: LocalCluster, install: Install, verb: str, resource: str, namespace: str) -> bool:
    result = cluster.kubectl(
        "auth",
        "can-i",
        verb,
        resource,
        "-n",
        namespace,
        f"--as=system:serviceaccount:{install.operator}:{FULLNAME}",
        check=False,
    )
    return result.stdout.strip() == "yes"


def test_operator_watches_exactly_the_listed_namespaces(
    cluster: LocalCluster, install: Install, model_hub: ModelHub
) -> None:
    cluster_objects = cluster.kubectl(
        "get", "clusterroles,clusterrolebindings", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name"
    ).stdout.split()
    assert cluster_objects == []
    name = f"scoped-{uuid.uuid4().hex[:5]}"
    for namespace in (*install.watched, install.unlisted):
        _apply(cluster, _manifest(name, namespace, model_hub))

    def reconciled(namespace: str) -> bool:
        # status written (the reconciler's conditions) and the pool's Deployment created
        return bool(_stalled(_isvc(cluster, namespace, name))) and f"deployment.apps/{name}-engine" in _children(
            cluster, namespace, name
        )

    for namespace in install.watched:
        cluster.wait_for(
            functools.partial(reconciled, namespace),
            timeout_seconds=CONVERGE_SECONDS,
            interval_seconds=1.0,
            what=f"{namespace}/{name} reconciled",
        )
    time.sleep(QUIET_SECONDS)  # the behaviour under test is that nothing happens in the unlisted one
    ignored = _isvc(cluster, install.unlisted, name)
    assert "status" not in ignored or not ignored["status"], ignored.get("status")
    assert _children(cluster, install.unlisted, name) == []
    assert not _can(cluster, install, "create", "deployments", install.unlisted)
    assert not _can(cluster, install, "list", ISVC_PLURAL, install.unlisted)
    assert _can(cluster, install, "create", "deployments", install.watched[1])


def test_inference_pool_mode_is_stalled_without_the_chart_toggle(
    cluster: LocalCluster, install: Install, model_hub: ModelHub
) -> None:
    namespace = install.watched[0]
    name = f"pool-{uuid.uuid4().hex[:5]}"
    _apply(cluster, _manifest(name, namespace, model_hub, mode="InferencePool"))

    def disabled() -> dict[str, Any] | None:
        stalled = _stalled(_isvc(cluster, namespace, name))
        return stalled if stalled.get("reason") == Reason.INFERENCE_POOL_DISABLED else None

    stalled = cluster.wait_for(
        disabled,
        timeout_seconds=CONVERGE_SECONDS,
        interval_seconds=1.0,
        what=f"{namespace}/{name} Stalled/{Reason.INFERENCE_POOL_DISABLED}",
    )
    assert stalled["status"] == "True" and "inferencePool.enabled=true" in stalled["message"]
    assert _children(cluster, namespace, name) == []
    for resource in ("serviceaccounts", "roles", "rolebindings"):
        assert not _can(cluster, install, "create", resource, namespace), resource
