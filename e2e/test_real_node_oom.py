"""Issue 11: failures that bite real clusters first, on the real node, and the
InferenceService saying so: a pool whose memory limit is too small is OOMKilled by the
kubelet; a runtime image the registry lacks ends in ErrImagePull / ImagePullBackOff.

The stack is ``test_real_node.py``'s (:func:`~splitserve_e2e.realnode.real_node_stack`: the
kubelet node, the image built from this working tree, the operator from the chart as a
restricted container, ``hf://splitserve/tiny-llama`` from a hub on the bridge gateway), with one
restricted workload namespace. The Aggregated InferenceService asks for
``spec.aggregated.resources.memory: 96Mi``, which the API server and Pod Security Admission
accept and the operator renders as the runtime container's memory request and limit. The
runtime cannot live in it: importing torch alone takes about 270 MiB of anonymous memory (the
Python interpreter and the HTTP server already most of 96 MiB), so the memory cgroup's OOM killer
kills it during start-up, every time, and the kubelet reports ``OOMKilled`` (exit code 137:
SIGKILL, passed on by tini) and restarts it into a crash loop.

Checked: the runtime container is terminated with reason ``OOMKilled`` under the 96Mi limit
(read from the pod, as ``kubectl`` shows it), and the InferenceService reports it through its
conditions, which are all that Argo CD, Flux and ``kubectl wait`` read: ``Stalled=True``,
``Ready=False`` and ``Reconciling=False``, each with reason ``OOMKilled`` and a message naming
the pod, the pool, the container and the limit (``pod tiny-aggregated-... (pool aggregated,
container runtime) was OOMKilled at its memory limit of 96Mi (exit code 137)``), not a bare
"not ready" or ``RolloutInProgress``. Bounded: each wait has a timeout and prints the pods'
statuses, events and logs and the node's log tails when it runs out. The InferenceService is
deleted at the end, with the module's namespaces and operator.

The image case sets ``spec.runtime.image`` to a tag the loopback registry does not have: the
kubelet's pull gets a 404, the container waits in ``ErrImagePull``/``ImagePullBackOff``, and
``Stalled=True`` and ``Ready=False`` carry that reason with the image reference in the message.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, get_isvc
from splitserve_e2e.hub import LocalHub
from splitserve_e2e.kubeletnode import NODE_NAME
from splitserve_e2e.realnode import (
    ISVC_NAME,
    Stack,
    explained,
    isvc_for_node,
    log,
    real_node_stack,
    wait,
)
from splitserve_e2e.stack import ModelHub

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

MEMORY_LIMIT = "96Mi"
"""Passes admission; far below what the runtime needs to import torch (~270 MiB anonymous)."""
OOM_TIMEOUT_SECONDS = 300.0
"""Apply -> the kubelet reports the first OOM kill (pod start, Python start, torch import)."""
STALLED_TIMEOUT_SECONDS = 180.0
"""First OOM kill -> Stalled=True/OOMKilled (a restart, then the operator's reconcile)."""


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, image: str, local_hub: LocalHub, model_hub: ModelHub) -> Iterator[Stack]:
    with real_node_stack(
        cluster=cluster,
        image=image,
        hub=local_hub,
        model_hub=model_hub,
        workloads=[f"inference-oom-{uuid.uuid4().hex[:4]}"],
    ) as result:
        yield result


def _runtime_pods(stack: Stack) -> list[Any]:
    core: Any = stack.cluster.core()
    selector = f"{contract.LABEL_INSTANCE}={ISVC_NAME},{contract.LABEL_COMPONENT}={contract.Role.AGGREGATED.value}"
    return list(core.list_namespaced_pod(stack.namespace, label_selector=selector).items)


def _oom_killed(stack: Stack) -> tuple[Any, Any] | None:
    """(pod, terminated state) of an aggregated pod whose runtime container the kubelet
    reported OOMKilled, now or as its last state."""
    for pod in _runtime_pods(stack):
        for status in pod.status.container_statuses or []:
            for state in (status.state, status.last_state):
                terminated = state.terminated if state is not None else None
                if terminated is not None and terminated.reason == Reason.OOM_KILLED:
                    return pod, terminated
    return None


def _conditions(stack: Stack, name: str = ISVC_NAME) -> dict[str, dict[str, Any]]:
    obj = get_isvc(cluster=stack.cluster, namespace=stack.namespace, name=name)
    return {str(c["type"]): c for c in (obj.get("status") or {}).get("conditions") or []}


def _describe(conditions: dict[str, dict[str, Any]]) -> str:
    return "\n".join(
        f"  {type_}={c.get('status')} reason={c.get('reason')}: {c.get('message')}"
        for type_, c in sorted(conditions.items())
    )


def test_pool_over_its_memory_limit_is_oom_killed_and_the_status_says_so(stack: Stack) -> None:
    cluster = stack.cluster
    manifest = isvc_for_node(stack, namespace=stack.namespace, mode="Aggregated", cpu="500m", memory=MEMORY_LIMIT)
    assert manifest["spec"]["aggregated"]["resources"]["memory"] == MEMORY_LIMIT
    try:
        with explained(cluster, stack.namespaces):
            started = time.monotonic()
            apply_object(cluster=cluster, obj=manifest)  # admission accepts the small limit

            # the kubelet OOM-kills the runtime under its limit
            pod, terminated = wait(
                cluster,
                lambda: _oom_killed(stack),
                timeout=OOM_TIMEOUT_SECONDS,
                what=f"the runtime container OOMKilled under {MEMORY_LIMIT}",
                interval=1.0,
            )
            killed = time.monotonic() - started
            container = pod.spec.containers[0]
            assert pod.spec.node_name == NODE_NAME
            assert container.name == "runtime"
            assert container.resources.limits["memory"] == MEMORY_LIMIT, container.resources
            assert terminated.exit_code == 137, terminated  # SIGKILL by the OOM killer
            log(f"{pod.metadata.name}: runtime OOMKilled (exit {terminated.exit_code}) {killed:.1f}s after apply")

            # the InferenceService says so, in every condition kstatus and kubectl wait read
            def stalled_oom() -> dict[str, dict[str, Any]] | None:
                found = _conditions(stack)
                stalled = found.get(ConditionType.STALLED) or {}
                return found if (stalled.get("status"), stalled.get("reason")) == ("True", Reason.OOM_KILLED) else None

            try:
                conditions = wait(
                    cluster,
                    stalled_oom,
                    timeout=STALLED_TIMEOUT_SECONDS,
                    what="Stalled=True reason OOMKilled on the InferenceService",
                    interval=1.0,
                )
            except BaseException:
                print(f"conditions at the timeout:\n{_describe(_conditions(stack))}")
                raise
            reported = time.monotonic() - started
            print(f"\nconditions of {stack.namespace}/{ISVC_NAME}:\n{_describe(conditions)}")
            failing = {p.metadata.name for p in _runtime_pods(stack)}
            for type_, status in (
                (ConditionType.STALLED, "True"),
                (ConditionType.READY, "False"),
                (ConditionType.RECONCILING, "False"),
            ):
                found = conditions[type_]
                message = str(found.get("message", ""))
                assert (found["status"], found["reason"]) == (status, Reason.OOM_KILLED), found
                # "pod <name> (pool aggregated, container runtime) was OOMKilled at its memory
                # limit of 96Mi (exit code 137)", then the container's log tail
                head = message.split(": ", 1)[0]
                assert head.startswith("pod ") and head.split()[1] in failing, (head, failing)
                assert (
                    f"(pool {contract.Role.AGGREGATED.value}, container runtime) was OOMKilled "
                    f"at its memory limit of {MEMORY_LIMIT} (exit code 137)"
                ) in head, message
            stack.figures["InferenceService apply -> runtime OOMKilled (kubelet)"] = f"{killed:.1f}s"
            stack.figures["InferenceService apply -> Stalled=True/OOMKilled"] = f"{reported:.1f}s"
            log(
                f"Stalled=True/OOMKilled {reported:.1f}s after apply "
                f"({reported - killed:.1f}s after the first kill was seen)"
            )
    finally:  # the cluster goes with the module; the crash loop stops now
        try:
            deleted = cluster.kubectl(
                "delete",
                "inferenceservice",
                ISVC_NAME,
                "-n",
                stack.namespace,
                "--ignore-not-found",
                "--wait=true",
                "--timeout=120s",
                check=False,
                timeout_seconds=150,
            )
            log(
                f"kubectl delete inferenceservice {ISVC_NAME}: rc {deleted.returncode} "
                f"{(deleted.stdout + deleted.stderr).strip()}"
            )
        except Exception as error:  # cleanup must not hide the test's outcome
            log(f"deleting the InferenceService failed: {error!r}")


MISSING_TAG = "no-such-build"
PULL_FAILED_TIMEOUT_SECONDS = 180.0
"""Apply -> the kubelet's ErrImagePull / ImagePullBackOff (the registry answers 404 at once),
then the operator's reconcile."""


def test_image_the_registry_lacks_is_reported_with_the_pull_error(stack: Stack) -> None:
    """What a platform team sees first when the image was never pushed: the kubelet cannot
    pull it (ErrImagePull, then ImagePullBackOff), and the InferenceService says which image."""
    cluster = stack.cluster
    missing = f"{stack.image.rsplit(':', 1)[0]}:{MISSING_TAG}"
    manifest = isvc_for_node(stack, namespace=stack.namespace, mode="Aggregated", cpu="100m")
    manifest["metadata"]["name"] = "unpulled"
    manifest["spec"]["runtime"]["image"] = missing
    pull_reasons = (Reason.ERR_IMAGE_PULL, Reason.IMAGE_PULL_BACK_OFF)
    try:
        with explained(cluster, stack.namespaces):
            started = time.monotonic()
            apply_object(cluster=cluster, obj=manifest)

            def stalled_on_pull() -> dict[str, Any] | None:
                found = _conditions(stack, "unpulled")
                stalled = found.get(ConditionType.STALLED) or {}
                return found if stalled.get("status") == "True" and stalled.get("reason") in pull_reasons else None

            conditions = wait(
                cluster,
                stalled_on_pull,
                timeout=PULL_FAILED_TIMEOUT_SECONDS,
                what="Stalled=True with the image pull error",
                interval=1.0,
            )
            reported = time.monotonic() - started
            print(f"\nconditions of {stack.namespace}/unpulled:\n{_describe(conditions)}")
            ready = conditions[ConditionType.READY]
            assert (ready["status"], ready["reason"]) == ("False", conditions[ConditionType.STALLED]["reason"])
            for type_ in (ConditionType.STALLED, ConditionType.READY):
                assert missing in str(conditions[type_].get("message", "")), conditions[type_]
            stack.figures["InferenceService apply -> Stalled=True/image pull error"] = f"{reported:.1f}s"
            log(f"Stalled=True/{conditions[ConditionType.STALLED]['reason']} {reported:.1f}s after apply")
    finally:
        cluster.kubectl(
            "delete",
            "inferenceservice",
            "unpulled",
            "-n",
            stack.namespace,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=120s",
            check=False,
            timeout_seconds=150,
        )
