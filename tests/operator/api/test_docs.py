"""docs/operator.md and the Argo CD health check it ships: the generated sections are
current, and the Lua script maps the operator's conditions to the right health status
(run in a real Lua interpreter through lupa)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import crdgen
import pytest

from splitserve_operator import api

REPO = Path(__file__).resolve().parents[3]
DOC = (REPO / crdgen.DOC_PATH).read_text()
LUA = (REPO / crdgen.HEALTH_LUA_PATH).read_text()


def test_doc_embeds_the_current_health_check_and_api_reference() -> None:
    assert crdgen.argocd_health_snippet(LUA) in DOC
    assert crdgen.api_reference() in DOC
    for field in ("spec.autoscaling.gpuBudget", "spec.kvCache.blockSize", "status.scalingHistory[].from"):
        assert f"`{field}`" in DOC, field
    for rule in (*api.SPEC_CEL_RULES, *api.POOL_CEL_RULES, *api.REPLICAS_CEL_RULES, *api.ROOT_CEL_RULES):
        assert rule["message"] in DOC


def test_doc_covers_install_gitops_and_names() -> None:
    for needle in (
        "helm install",
        "rbac.scope=namespace",
        "ignoreDifferences",
        "jqPathExpressions",
        "splitserve-autoscaler",
        "kubectl apply --server-side --force-conflicts -f helm/splitserve/crds/",
        "at most 40 characters",
    ):
        assert needle in DOC, needle


def _health(obj: dict[str, Any]) -> tuple[str, str]:
    lupa = pytest.importorskip("lupa")
    runtime = lupa.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(value: Any) -> Any:
        if isinstance(value, dict):
            return runtime.table_from({k: to_lua(v) for k, v in value.items()})
        if isinstance(value, list):
            return runtime.table_from([to_lua(v) for v in value])
        return value

    check = runtime.eval(f"function(obj)\n{LUA}\nend")
    result = check(to_lua(obj))
    return str(result["status"]), str(result["message"])


def _obj(
    *conditions: tuple[str, str, str],
    generation: int = 2,
    observed: int | None = 2,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": t, "status": s, "reason": r, "message": f"{t} is {s}"} for t, s, r in conditions]
    }
    if observed is not None:
        status["observedGeneration"] = observed
    meta: dict[str, Any] = {"name": "x", "generation": generation}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "status": status}


@pytest.mark.parametrize(
    ("obj", "status", "message"),
    [
        ({"metadata": {"name": "x", "generation": 1}}, "Progressing", "Waiting for the operator"),
        (_obj(("Ready", "True", "Reconciled")), "Healthy", "Reconciled: Ready is True"),
        (_obj(("Ready", "True", "Reconciled"), observed=1), "Progressing", "observe generation 2"),
        (_obj(("Ready", "True", "Reconciled"), observed=None), "Progressing", "observe generation 2"),
        (_obj(("Ready", "False", "NameConflict"), ("Stalled", "True", "NameConflict")), "Degraded", "NameConflict"),
        (
            _obj(("Ready", "False", "PodsNotReady"), ("Reconciling", "True", "Progressing")),
            "Progressing",
            "Progressing: Reconciling is True",
        ),
        (_obj(("Ready", "False", "PodsNotReady")), "Progressing", "PodsNotReady"),
        (_obj(("Ready", "True", "Reconciled"), annotations={"splitserve.dev/paused": "true"}), "Suspended", "paused"),
    ],
)
def test_argocd_health(obj: dict[str, Any], status: str, message: str) -> None:
    got_status, got_message = _health(obj)
    assert got_status == status
    assert re.search(re.escape(message), got_message), got_message
