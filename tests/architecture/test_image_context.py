"""The image's rebuild stamp hashes exactly the build context the Containerfile sees.

``splitserve_e2e.image`` decides whether ``make image`` must rebuild from a hash over
``CONTEXT_PATHS``; the builder sees what ``.containerignore`` lets through. If the two lists
drift, a change could reach the image without a rebuild (or never reach it), so they are
checked against each other here, together with the pip constraints the Containerfile copies.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import setuptools

from splitserve_e2e.image import CONSTRAINTS_FILE, CONTEXT_PATHS, IGNORE_FILE

REPO = Path(__file__).resolve().parents[2]


def _whitelist() -> list[str]:
    lines = (REPO / IGNORE_FILE).read_text().splitlines()
    return [line[1:] for line in lines if line.startswith("!")]


def test_stamp_inputs_are_the_build_context() -> None:
    assert sorted(_whitelist()) == sorted(CONTEXT_PATHS)
    assert "*" in (REPO / IGNORE_FILE).read_text().splitlines()  # everything else stays out


def test_containerfile_installs_with_the_committed_constraints() -> None:
    containerfile = (REPO / "Containerfile").read_text()
    assert f"COPY {CONSTRAINTS_FILE} " in containerfile
    assert containerfile.count("-c /opt/splitserve/requirements/constraints.txt") == 2
    pins = [line for line in (REPO / CONSTRAINTS_FILE).read_text().splitlines() if line and not line.startswith("#")]
    assert pins and all("==" in line for line in pins), pins
    names = {line.split("==")[0].lower() for line in pins}
    assert {"kopf", "kubernetes", "pydantic", "torch", "triton"} <= names


def _product_packages() -> list[str]:
    """The packages the product's wheel (and so the image) gets, found as setuptools finds
    them from the root pyproject.toml."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [
        package
        for where in find["where"]
        for package in setuptools.find_packages(str(REPO / where), include=find["include"])
    ]


def test_the_e2e_harness_is_neither_in_the_wheel_nor_in_the_image() -> None:
    # The harness (builds etcd and Kubernetes, runs the demo) is its own distribution,
    # e2e/pyproject.toml: a harness edit must not rebuild the image, and no pod runs it.
    packages = _product_packages()
    assert "splitserve_runtime" in packages and "splitserve_operator.autoscaler" in packages
    assert not [p for p in packages if p.split(".")[0] == "splitserve_e2e"], packages
    assert not [p for p in CONTEXT_PATHS if p.startswith("e2e")], CONTEXT_PATHS
    harness = tomllib.loads((REPO / "e2e/pyproject.toml").read_text())
    assert harness["tool"]["setuptools"]["packages"] == ["splitserve_e2e"]
    assert any(d.startswith("splitserve[") for d in harness["project"]["dependencies"])
