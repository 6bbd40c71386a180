"""A model that cannot be loaded shows in the InferenceService's status, not only in pod logs.

With downloads off (``HF_HUB_OFFLINE=1``), a runtime pod whose hf:// model is not in its
cache exits at start-up with a ModelLoadError (``test_model_hub.py`` covers a refused
download). The chart's operator (a container on the kubelet node) must turn the pod's
termination message (the kubelet falls back to the log tail, as ``terminationMessagePolicy:
FallbackToLogsOnError`` says) into Ready=False with reason ModelUnavailable and the runtime's
own words in the message.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import splitserve_contract as contract
from splitserve_contract import ConditionType, Reason
from splitserve_e2e.cluster import LocalCluster
from splitserve_e2e.demo import apply_object, condition, get_isvc, pod_summary
from splitserve_e2e.stack import ModelHub, isvc_manifest, operator_namespace

pytestmark = pytest.mark.e2e

NAME = "missing-model"
MISSING_MODEL = "hf://nobody/not-in-cache"
TIMEOUT_SECONDS = 240.0
POLL_SECONDS = 1.0


@pytest.fixture(scope="module")
def namespace(cluster: LocalCluster, image: str, model_hub: ModelHub) -> Iterator[str]:
    with operator_namespace(cluster=cluster, image=image, hub=model_hub, stem="nomodel") as name:
        manifest = isvc_manifest(name=NAME, namespace=name, mode="Aggregated", hub=model_hub)
        manifest["spec"]["model"]["uri"] = MISSING_MODEL
        # Cache only: the pods would otherwise try to download it.
        manifest["spec"]["runtime"]["env"] = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
        manifest["spec"]["autoscaling"]["enabled"] = False
        apply_object(cluster=cluster, obj=manifest)
        yield name


def test_missing_model_is_reported_as_model_unavailable(namespace: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    seen: dict[str, object] = {}
    while time.monotonic() < deadline:
        ready = condition(get_isvc(cluster=cluster, namespace=namespace, name=NAME), ConditionType.READY) or {}
        seen = ready
        if ready.get("reason") == Reason.MODEL_UNAVAILABLE:
            break
        time.sleep(POLL_SECONDS)
    else:
        pytest.fail(
            f"no {Reason.MODEL_UNAVAILABLE} within {TIMEOUT_SECONDS:.0f}s; Ready={seen}\n"
            f"{pod_summary(cluster=cluster, namespace=namespace)}"
        )
    assert seen["status"] == "False"
    assert "not in the local cache" in str(seen["message"]), seen
    assert MISSING_MODEL in str(seen["message"]), seen
    obj = get_isvc(cluster=cluster, namespace=namespace, name=NAME)
    stalled = condition(obj, ConditionType.STALLED) or {}
    assert (stalled.get("status"), stalled.get("reason")) == ("True", Reason.MODEL_UNAVAILABLE), stalled
    warnings = cluster.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "-o",
        "jsonpath={range .items[*]}{.reason}/{.type}{'\\n'}{end}",
        "--field-selector",
        f"involvedObject.kind={contract.KIND},involvedObject.name={NAME}",
    )
    assert f"{Reason.MODEL_UNAVAILABLE}/Warning" in warnings.stdout.split(), warnings.stdout
