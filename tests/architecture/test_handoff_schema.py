"""The prefill → decode handoff object has one definition: its field names are spelled only in
:mod:`splitserve_contract.handoff` (docs/architecture.md, "Contracts").

A field name written as a string literal anywhere else in the product is how the handoff
drifted into a dict read and written by five modules; every other module uses the contract's
constants or the typed :class:`~splitserve_contract.handoff.HandoffParams`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from splitserve_contract import handoff

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("contract", "operator", "runtime", "planner", "cli")
SCHEMA = ROOT / "contract" / "splitserve_contract" / "handoff.py"
NAMES = frozenset({*handoff.HANDOFF_FIELDS, handoff.DO_REMOTE_DECODE})
ALSO_ELSEWHERE = {
    "contract/splitserve_contract/flags.py": {"compat_hash"},  # the --compat-hash flag's dest
    "runtime/splitserve_runtime/router/pods.py": {"compat_hash"},  # the pod-info answer's field
}
"""Files where a handoff field's name is also the name of another object's field."""


def literal_uses(path: Path, *, root: Path = ROOT) -> list[str]:
    """``file:line name`` (relative to ``root``) for each string constant in ``path`` equal to a
    handoff field name (docstrings and comments aside: they are not constants, or not code)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.value}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in NAMES
        and id(node) not in docstrings
    ]


def test_the_names_are_what_travels() -> None:
    assert {
        "remote_endpoint",
        "remote_request_id",
        "num_prompt_tokens",
        "first_token_id",
        "compat_hash",
        "prompt_digest",
        "expires_at",
        "signature",
        "kv_layout",
        "do_remote_decode",
    } == NAMES


def test_no_handoff_field_name_is_spelled_outside_the_schema() -> None:
    found = [
        use
        for folder in PRODUCT
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != SCHEMA and "tools" not in path.parts
        for use in literal_uses(path)
        if use.split()[-1] not in ALSO_ELSEWHERE.get(str(path.relative_to(ROOT)), set())
    ]
    assert found == []


def test_the_scan_finds_a_literal(tmp_path: Path) -> None:
    """The check is not vacuous: a module that spells a field is reported."""
    probe = tmp_path / "runtime" / "splitserve_runtime" / "_handoff_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text('"""probe"""\nPARAMS = {"remote_endpoint": "h:1"}\n')
    assert literal_uses(probe, root=tmp_path) == ["runtime/splitserve_runtime/_handoff_probe.py:2 remote_endpoint"]
