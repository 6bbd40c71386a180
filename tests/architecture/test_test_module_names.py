"""`make test` collects tests/ and e2e/ in one pytest run with rootdir-relative imports
(no packages), so two test modules with one basename make collection fail at once
("import file mismatch"): keep every basename unique."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_test_module_basenames_are_unique_across_tests_and_e2e() -> None:
    names = Counter(p.name for root in ("tests", "e2e") for p in (REPO / root).rglob("test_*.py"))
    assert {name for name, count in names.items() if count > 1} == set()
