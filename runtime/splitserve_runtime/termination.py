"""The termination message: why the process exits, where Kubernetes shows it.

Shared by the server (a model that fails to load) and the engine (a tensor-parallel worker
rank that died), so it lives beside both rather than in either.
"""

from __future__ import annotations

import logging
import os

import splitserve_contract as contract

logger = logging.getLogger(__name__)

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


__all__ = ["TERMINATION_LOG_ENV", "write_termination_message"]
