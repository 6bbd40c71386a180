"""The operator's RBAC as the chart renders it, for tests that check the operator may write
what it renders (``helm template`` with the pinned helm binary the e2e build caches)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "splitserve"


def helm_binary() -> str | None:
    """``$SPLITSERVE_HELM``, helm on PATH, or the newest cached build; None without one."""
    found = os.environ.get("SPLITSERVE_HELM") or shutil.which("helm")
    cached = sorted(glob.glob(str(Path.home() / ".cache" / "splitserve" / "bin" / "helm-*" / "helm")))
    return found or (cached[-1] if cached else None)


def operator_rules(*, sets: tuple[str, ...], kind: str) -> list[dict[str, Any]]:
    """The rules of the operator's ``kind`` (ClusterRole or Role) rendered with ``--set sets``."""
    helm = helm_binary()
    assert helm is not None
    args = [helm, "template", "rel", str(CHART), "--namespace", "ops"]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    role = next(
        d for d in yaml.safe_load_all(out) if d and d["kind"] == kind and d["metadata"]["name"] == "rel-splitserve"
    )
    rules: list[dict[str, Any]] = role["rules"]
    return rules


def holds(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether ``rules`` grant ``verb`` on every object of ``resource`` (a rule limited to
    ``resourceNames`` does not count)."""
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] and "resourceNames" not in r
        for r in rules
    )
