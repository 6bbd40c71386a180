"""No hub call waits forever: the defect this pins was a hub that accepts connections and
never answers making start-up wait forever with nothing in the log (``model_info`` and the
library's other requests had no timeout).

Real sockets on loopback, the real ``huggingface_hub`` client: a listener that accepts and
never sends a byte, and the test hub (:class:`splitserve_e2e.hub.LocalHub`) that stalls in
the middle of a file. Each case runs the load on a thread joined with a deadline of the
test's own, so a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from silent_listener import SilentListener

from splitserve_contract import ENV_HUB_ENDPOINT, ENV_HUB_OFFLINE, ENV_MODEL_CACHE
from splitserve_e2e.hub import LocalHub
from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.download import (
    ENV_REQUEST_TIMEOUT,
    ENV_STALL_TIMEOUT,
    HubSettings,
    HubTimeouts,
)
from splitserve_runtime.model.uri import resolve_model_uri

TEST_DEADLINE_SECONDS = 60.0
"""The test's own bound: far above what the runtime should take (a few seconds)."""


def within_deadline(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``call`` on a thread; (what it raised, seconds), or fail the test at the deadline."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TEST_DEADLINE_SECONDS)
    if thread.is_alive():
        pytest.fail(f"the model load still waits on the hub after {TEST_DEADLINE_SECONDS:.0f} s")
    return outcome[0], time.monotonic() - started


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    import huggingface_hub.constants

    monkeypatch.delenv(ENV_HUB_OFFLINE, raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_DOWNLOAD_TIMEOUT", huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT
    )  # the runtime sets it
    monkeypatch.setenv(ENV_REQUEST_TIMEOUT, "2")
    monkeypatch.setenv(ENV_STALL_TIMEOUT, "2")
    cache = tmp_path / "cache"
    monkeypatch.setenv(ENV_MODEL_CACHE, str(cache))
    return cache


@pytest.fixture
def silent(monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentListener]:
    with SilentListener() as listener:
        monkeypatch.setenv(ENV_HUB_ENDPOINT, listener.endpoint)
        yield listener


@pytest.mark.parametrize("uri", ["hf://org/tiny", "hf://org/tiny/model.Q4_0.gguf"])
def test_a_hub_that_never_answers_fails_in_seconds_naming_it(
    online: Path,
    silent: SilentListener,
    uri: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="splitserve_runtime.model.download")
    error, seconds = within_deadline(lambda: resolve_model_uri(uri, cache_dir=None))
    assert isinstance(error, ModelLoadError), error
    message = str(error)
    assert f"the hub endpoint {silent.endpoint} accepted the connection but did not answer in time" in message
    assert ENV_HUB_ENDPOINT in message and ENV_REQUEST_TIMEOUT in message
    assert seconds < 20, f"took {seconds:.1f} s"
    assert silent.accepted, "the listener was never dialled"
    waits = [r.getMessage() for r in caplog.records if "asking the hub at" in r.getMessage()]
    assert waits and silent.endpoint in waits[0]  # said where it waits, before waiting


def test_a_download_that_stops_mid_file_fails_in_seconds(
    online: Path,
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The hub answers the metadata, then sends 64 KiB of the weights and nothing more for
    minutes: the library's retries (each a resumed GET that would wait again) are cut short
    once nothing has arrived for the stall bound."""
    assert (tiny_llama_dir / "model.safetensors").stat().st_size > 64 * 1024
    caplog.set_level(logging.INFO, logger="splitserve_runtime.model.download")
    with LocalHub(tmp_path / "hub", chunk_delay_seconds=300) as hub:
        hub.publish("org/tiny", tiny_llama_dir)
        monkeypatch.setenv(ENV_HUB_ENDPOINT, hub.endpoint)
        error, seconds = within_deadline(lambda: resolve_model_uri("hf://org/tiny", cache_dir=None))
    assert isinstance(error, ModelLoadError), error
    message = str(error)
    assert hub.endpoint in message
    assert "did not answer in time" in message or "sent nothing for" in message, message
    assert seconds < 30, f"took {seconds:.1f} s"
    fetches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fetching ")]
    assert fetches and all(hub.endpoint in line for line in fetches)
    assert not (online / "models--org--tiny" / "refs").exists()  # nothing looks complete


def test_timeouts_come_from_the_hub_variables_and_bad_values_are_refused() -> None:
    assert HubTimeouts.from_env({}) == HubTimeouts()
    timeouts = HubTimeouts.from_env({ENV_REQUEST_TIMEOUT: "3", ENV_STALL_TIMEOUT: "7.5"})
    assert (timeouts.connect_seconds, timeouts.request_seconds, timeouts.stall_seconds) == (3.0, 3.0, 7.5)
    assert HubSettings.from_env({ENV_STALL_TIMEOUT: "9"}).timeouts.stall_seconds == 9.0
    for bad in ("soon", "0", "-1", "inf", "nan"):
        with pytest.raises(ModelLoadError, match=ENV_STALL_TIMEOUT):
            HubTimeouts.from_env({ENV_STALL_TIMEOUT: bad})
