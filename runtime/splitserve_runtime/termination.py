"""The termination message: why the process exits, where Kubernetes shows it.

Shared by the server (a model that fails to load) and the engine (a tensor-parallel worker
rank that died), so it lives beside both rather than in either.

:func:`log_startup_failure` decides how a start-up failure reaches the pod log: an expected
one (the model is unavailable or unusable, a bad revision, an unreachable hub, a setting this
version refuses: :data:`EXPECTED_STARTUP_ERRORS`) is one ERROR line holding the same text as
the termination message, because its message already says everything a traceback would and a
traceback around it buries it; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os

import splitserve_contract as contract
from splitserve_contract.capabilities import UnsupportedError
from splitserve_contract.model_config import ModelLoadError

logger = logging.getLogger(__name__)

EXPECTED_STARTUP_ERRORS: tuple[type[BaseException], ...] = (ModelLoadError, UnsupportedError)
"""Start-up failures whose message is the whole story (logged without a traceback)."""

TERMINATION_LOG_ENV = "SPLITSERVE_TERMINATION_LOG"
"""Overrides :data:`~splitserve_contract.TERMINATION_MESSAGE_PATH` (a pod's
``terminationMessagePath`` other than the default; tests)."""
MAX_TERMINATION_MESSAGE_BYTES = 4096  # the kubelet reads at most this much


def write_termination_message(message: str) -> bool:
    """Tell Kubernetes why the process exits: write ``message`` to the termination message
    file, which the kubelet shows as the container's ``lastState.terminated.message`` (and the
    operator in the InferenceService's conditions). Only a file that already exists is
    written (the kubelet creates it in a container); nothing is created, so running the
    server on a dev machine never touches ``/dev``. Returns whether it was written."""
    path = os.environ.get(TERMINATION_LOG_ENV) or contract.TERMINATION_MESSAGE_PATH
    data = message.encode("utf-8", "replace")[:MAX_TERMINATION_MESSAGE_BYTES]
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "r+b") as handle:  # r+: never creates the file
            handle.write(data)
            handle.truncate()
    except OSError as exc:
        logger.warning("cannot write the termination message to %s: %s", path, exc)
        return False
    return True


def startup_failure_message(exc: BaseException) -> str:
    """The termination message for a start-up failure: ``Type: message`` on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def log_startup_failure(exc: BaseException, *, log: logging.Logger, what: str) -> str:
    """Log that ``what`` failed because of ``exc`` (see the module docstring) and return the
    termination message."""
    message = startup_failure_message(exc)
    if isinstance(exc, EXPECTED_STARTUP_ERRORS):
        log.error("%s: %s", what, message)
    else:
        log.error("%s: %s", what, message, exc_info=exc)
    return message


__all__ = [
    "EXPECTED_STARTUP_ERRORS",
    "TERMINATION_LOG_ENV",
    "log_startup_failure",
    "startup_failure_message",
    "write_termination_message",
]
