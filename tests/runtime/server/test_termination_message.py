"""`splitserve serve` tells Kubernetes why it exits, without creating files on a dev machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve_runtime import termination as app


def test_written_only_to_an_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "termination-log"
    monkeypatch.setenv(app.TERMINATION_LOG_ENV, str(missing))
    assert not app.write_termination_message("ModelLoadError: model 'hf://a/b' is not in the local cache")
    assert not missing.exists()
    missing.write_text("stale text that is longer than the message")
    assert app.write_termination_message("ModelLoadError: boom")
    assert missing.read_text() == "ModelLoadError: boom"
    assert app.write_termination_message("x" * 10_000)
    assert len(missing.read_bytes()) == app.MAX_TERMINATION_MESSAGE_BYTES
