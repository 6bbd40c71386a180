"""Last words before a broken parallel group ends the serving process.

A rank that dies (or a group that breaks in any other way) ends rank 0's process with
``os._exit`` (:func:`.launcher.exit_group`): the model cannot run without every rank, and
nothing may unwind through a collective that can never complete. Nothing unwinding also means
no response in flight is finished: a stream would end with a cut connection instead of the
error event an OpenAI client reads, depending only on whether the engine thread's failed
collective or the supervisor's poll saw the death first.

So whichever thread finds the break first runs these hooks before the exit (:func:`run`), in
two stages whatever order they were added in: ``fail`` (the engine fails every open stream:
:class:`~..async_engine.AsyncEngine`), then ``flush`` (the server waits, bounded, until the
requests in flight have sent their error: :mod:`splitserve_runtime.server.app`). They are
process-wide because the exit is. This module is torch-free: the server imports it before any
engine exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)

Hook = Callable[[str], None]
"""Called with the reason the process is ending; from any thread but the event loop's."""
Stage = Literal["fail", "flush"]
STAGES: tuple[Stage, ...] = ("fail", "flush")

_lock = threading.Lock()
_hooks: list[tuple[Stage, Hook]] = []
_started = threading.Event()


def add(hook: Hook, *, stage: Stage) -> Callable[[], None]:
    """Run ``hook`` in ``stage`` before a broken group ends the process; returns the function
    that removes it again."""
    entry = (stage, hook)
    with _lock:
        _hooks.append(entry)

    def remove() -> None:
        with _lock:
            if entry in _hooks:
                _hooks.remove(entry)

    return remove


def run(reason: str) -> None:
    """The group broke (``reason``) and the process is about to end: run the hooks, stage by
    stage, each bounded by itself; one that raises is logged and the others still run."""
    _started.set()
    with _lock:
        hooks = [hook for stage in STAGES for kind, hook in _hooks if kind == stage]
    for hook in hooks:
        try:
            hook(reason)
        except Exception:
            log.exception("a hook before the process exit failed")


def started() -> bool:
    """Whether a broken group is ending the process (the hooks have begun): the server then
    leaves the exit to it rather than start its own shutdown (whose exit status would hide
    the group's)."""
    return _started.is_set()
