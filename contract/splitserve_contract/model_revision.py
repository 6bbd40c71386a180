"""Which model revisions (``--revision``, ``hf://org/name@revision``, ``spec.model.revision``)
are accepted: a plausible git branch, tag or commit hash, and nothing else.

Why a rule at all: the runtime looks a revision up as a file name in the hub cache
(``models--org--name/refs/<revision>``), writes that file after a download, and sends the
revision to the hub in a URL. A revision such as ``../../../../proc/self/environ`` would read
(or overwrite) a file outside the cache. So the revision is checked before it is used for
anything, on both sides that see it: the operator's CRD refuses it at admission
(:data:`REVISION_PATTERN`, :data:`MAX_REVISION_LENGTH`) and the runtime refuses it again at
start-up (:func:`revision_problem`), since the runtime can also be started by hand.

The rule is a subset of git's ``check-ref-format`` (what the hub accepts as a branch or tag
name), limited to the characters real revisions use: ``/``-separated parts, each made of
ASCII letters, digits, ``_``, ``-``, ``+`` and single dots between them; a part never starts
with ``.`` or ``-`` and never ends with ``.`` (so no ``.``/``..`` segment, no hidden file, no
option-looking value). Commit hashes (hex), ``v1.0``, ``release/2024-06``, ``refs/pr/1`` all
match. Leading ``/``, backslashes, control characters, spaces, ``@``, ``~``, ``^``, ``:``,
``?``, ``*``, ``[`` and non-ASCII never do.

:data:`REVISION_PATTERN` uses only what both Python's ``re`` and RE2 (the Kubernetes API
server's OpenAPI ``pattern``) support: no look-around, no back-references.
"""

from __future__ import annotations

import re
from typing import Final

MAX_REVISION_LENGTH: Final = 255
"""Longest accepted revision, in characters (a git ref name is a file name: 255 bytes)."""

_PART: Final = r"[A-Za-z0-9_][A-Za-z0-9_+-]*(?:\.[A-Za-z0-9_+-]+)*"
REVISION_PATTERN: Final = rf"^{_PART}(?:/{_PART})*$"
"""A non-empty revision (see the module docstring); RE2-compatible for the CRD's ``pattern``."""
_REVISION: Final = re.compile(REVISION_PATTERN)
_ALLOWED_CHARACTERS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-./")

REVISION_RULE: Final = (
    "a revision is a git branch, tag or commit hash: '/'-separated parts of ASCII letters, "
    "digits, '_', '-', '+' and single '.' between them, each part starting with a letter, "
    "digit or '_' and not ending with '.'"
)
"""The rule in words, for messages (the CRD field's description may quote it)."""

_SHOWN_CHARACTERS: Final = 64


def revision_problem(revision: str) -> str | None:
    """Why ``revision`` is refused, in words naming the rule it breaks, or None when it is
    acceptable. The empty string is acceptable: it means the default revision (``main``).

    The message quotes the revision (escaped, cut to 64 characters): it is what the user
    wrote, never the content of a file."""
    if not revision:
        return None
    why = _first_problem(revision)
    if why is None:
        return None
    shown = revision if len(revision) <= _SHOWN_CHARACTERS else revision[:_SHOWN_CHARACTERS] + "..."
    return f"revision {shown!r} is refused: {why}; {REVISION_RULE}"


def is_valid_revision(revision: str) -> bool:
    """Whether :func:`revision_problem` accepts ``revision`` (the empty string included)."""
    return revision_problem(revision) is None


def _first_problem(revision: str) -> str | None:
    if len(revision) > MAX_REVISION_LENGTH:
        return f"it is longer than {MAX_REVISION_LENGTH} characters"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in revision):
        return "it contains a control character"
    if "\\" in revision:
        return "it contains a backslash"
    if revision.startswith("/"):
        return "it starts with '/' (an absolute path)"
    parts = revision.split("/")
    if ".." in parts:
        return "it contains a '..' path segment"
    if "." in parts:
        return "it contains a '.' path segment"
    bad = sorted({c for c in revision if c not in _ALLOWED_CHARACTERS})
    if bad:
        return f"it contains {', '.join(repr(c) for c in bad[:5])}, not allowed in a revision"
    if "" in parts:
        return "it has an empty '/'-separated part (a trailing '/' or '//')"
    if ".." in revision:
        return "it contains '..'"
    if _REVISION.fullmatch(revision) is None:
        return "a part starts with '.' or '-' or ends with '.'"
    return None


__all__ = ["MAX_REVISION_LENGTH", "REVISION_PATTERN", "REVISION_RULE", "is_valid_revision", "revision_problem"]
