"""An API key that is configured but empty stops the runtime server and the router at start-up.

The defect this pins: ``os.environ.get("SPLITSERVE_API_KEY") or None`` turned an empty key (a
Secret whose value is empty, or a runtime.env entry that replaced the secretKeyRef) into "no
key", and both answered every client with 200 while the InferenceService said Ready. The
processes here are the real ``splitserve serve`` / ``splitserve router`` entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import splitserve_contract as contract
from splitserve_runtime.auth import APIKeyConfigError, api_key_from_env
from splitserve_runtime.termination import TERMINATION_LOG_ENV

START_TIMEOUT_SECONDS = 60


def test_unset_means_no_key_and_a_value_is_the_key() -> None:
    assert api_key_from_env({}) is None
    assert api_key_from_env({contract.ENV_API_KEY: "s3cret"}) == "s3cret"


@pytest.mark.parametrize("value", ["", " ", "\n", "\t \n"])
def test_set_but_empty_is_refused_without_echoing_anything(value: str) -> None:
    with pytest.raises(APIKeyConfigError, match=f"{contract.ENV_API_KEY} is set but empty") as info:
        api_key_from_env({contract.ENV_API_KEY: value})
    assert "\n" not in str(info.value)  # one line


def _run(argv: list[str], *, key: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates it; the runtime only writes an existing file
    env = {**os.environ, contract.ENV_API_KEY: key, TERMINATION_LOG_ENV: str(log)}
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve_cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_SECONDS,
        check=False,
    )
    return proc, log


@pytest.mark.parametrize("key", ["", "   "])
def test_serve_refuses_to_start_with_an_empty_key(key: str, tmp_path: Path) -> None:
    proc, log = _run(
        ["serve", "--model", "file:///nonexistent", "--device", "cpu", "--host", "127.0.0.1", "--port", "1"],
        key=key,
        tmp_path=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{contract.ENV_API_KEY} is set but empty" in proc.stderr
    assert f"{contract.ENV_API_KEY} is set but empty" in log.read_text()  # shown in the pod's status


@pytest.mark.parametrize("key", ["", "\t"])
def test_router_refuses_to_start_with_an_empty_key(key: str, tmp_path: Path) -> None:
    proc, _ = _run(
        [
            "router",
            "--discovery",
            "static",
            "--aggregated-endpoints",
            "127.0.0.1:1",
            "--host",
            "127.0.0.1",
            "--port",
            "1",
        ],
        key=key,
        tmp_path=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if contract.ENV_API_KEY in line]
    assert len(lines) == 1 and "is set but empty" in lines[0], proc.stderr
