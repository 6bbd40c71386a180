"""The package layers hold (import-linter) and a deliberate violation is caught.

``.importlinter`` states the rules (docs/architecture.md, "Layers"). The first test runs
``lint-imports`` on the repository as CI does; the others copy the packages to a temporary
tree, add one forbidden import and check that ``lint-imports`` fails naming the broken
contract, so a rule that silently matches nothing cannot pass unnoticed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {
    "splitserve_contract": "contract",
    "splitserve_operator": "operator",
    "splitserve_runtime": "runtime",
    "splitserve_planner": "planner",
    "splitserve_cli": "cli",
}


def _lint_imports(*, cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    exe = shutil.which("lint-imports")
    argv = [exe] if exe else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run(
        [*argv, "--config", str(cwd / ".importlinter"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy_tree(tmp_path: Path) -> list[Path]:
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    roots = []
    for package, folder in PACKAGE_DIRS.items():
        shutil.copytree(
            ROOT / folder / package, tmp_path / folder / package, ignore=shutil.ignore_patterns("__pycache__")
        )
        roots.append(tmp_path / folder)
    return roots


def test_repository_keeps_every_layer_contract() -> None:
    result = _lint_imports(cwd=ROOT, pythonpath=[ROOT / f for f in PACKAGE_DIRS.values()])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and " 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (
            "operator/splitserve_operator/_probe.py",
            "import torch\n",
            "The operator never imports the runtime's heavy dependencies",
        ),
        (
            "operator/splitserve_operator/_probe.py",
            "from splitserve_runtime.engine import config\n",
            "Packages: cli above operator/runtime/planner",
        ),
        (
            "contract/splitserve_contract/_probe.py",
            "import pydantic\n",
            "The contract imports only the standard library",
        ),
        (
            "runtime/splitserve_runtime/engine/_probe.py",
            "from splitserve_runtime.server import errors\n",
            "The engine never imports the HTTP server or the router",
        ),
        (
            "runtime/splitserve_runtime/kernels/_probe.py",
            "from splitserve_runtime.ops import interface\n",
            "Runtime: server and router above the engine, kernels at the bottom",
        ),
        (
            "runtime/splitserve_runtime/engine/_probe.py",
            "from splitserve_runtime.disagg import routes\n",
            "Runtime: server and router above the engine, kernels at the bottom",
        ),
        (
            "runtime/splitserve_runtime/disagg/_probe.py",
            "from splitserve_runtime.server import errors\n",
            "Runtime: server and router above the engine, kernels at the bottom",
        ),
        (
            "planner/splitserve_planner/_probe.py",
            "from splitserve_operator import kube\n",
            "The planner reaches the operator only through its pure API",
        ),
    ],
)
def test_a_deliberate_violation_fails(tmp_path: Path, module: str, line: str, contract: str) -> None:
    roots = _copy_tree(tmp_path)
    (tmp_path / module).write_text(f'"""A forbidden import (test probe)."""\n{line}')
    result = _lint_imports(cwd=tmp_path, pythonpath=roots)
    assert result.returncode != 0, result.stdout
    flat = " ".join(result.stdout.split())  # long contract names wrap in the report
    assert re.search(re.escape(contract) + r"[^\n]{0,80}? BROKEN", flat), result.stdout


OPERATOR_LAYERS = "Operator: kopf handlers above the reconciler and the autoscaler"
AUTOSCALER_LAYERS = "Autoscaler: the loop above the SLO autoscaler"
KUBE_GATEWAY = "Operator: only the gateway (kube) imports the Kubernetes client"


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("operator/splitserve_operator/status.py", "import kubernetes\n", KUBE_GATEWAY),
        (
            "operator/splitserve_operator/autoscaler/slo/store.py",
            "from kubernetes.client.exceptions import ApiException\n",
            KUBE_GATEWAY,
        ),
        ("operator/splitserve_operator/kube.py", "from splitserve_operator import reconcile\n", OPERATOR_LAYERS),
        ("operator/splitserve_operator/naming.py", "from splitserve_operator import api\n", OPERATOR_LAYERS),
        (
            "operator/splitserve_operator/autoscaler/actuator.py",
            "from splitserve_operator.autoscaler import loop\n",
            AUTOSCALER_LAYERS,
        ),
        (
            "operator/splitserve_operator/autoscaler/signals.py",
            "from splitserve_operator.autoscaler.slo import inputs\n",
            AUTOSCALER_LAYERS,
        ),
    ],
)
def test_a_forbidden_import_in_an_operator_module_fails(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """The operator's own contracts, probed inside existing modules (a new module would also
    break the exhaustive layers contract, and so prove less)."""
    roots = _copy_tree(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + line)
    result = _lint_imports(cwd=tmp_path, pythonpath=roots)
    assert result.returncode != 0, result.stdout
    flat = " ".join(result.stdout.split())
    assert re.search(re.escape(contract) + r"[^\n]{0,120}? BROKEN", flat), result.stdout
    assert re.search(r"Contracts: \d+ kept, 1 broken", flat), result.stdout  # this contract alone


def test_an_operator_module_outside_every_layer_fails(tmp_path: Path) -> None:
    """The operator's layers are exhaustive: a new module must be given its place."""
    roots = _copy_tree(tmp_path)
    (tmp_path / "operator/splitserve_operator/_probe.py").write_text('"""A module in no layer (test probe)."""\n')
    result = _lint_imports(cwd=tmp_path, pythonpath=roots)
    assert result.returncode != 0, result.stdout
    flat = " ".join(result.stdout.split())
    assert re.search(re.escape(OPERATOR_LAYERS) + r"[^\n]{0,120}? BROKEN", flat), result.stdout
    assert "splitserve_operator._probe" in flat, result.stdout
