"""``status.<pool>.recentDecisions``: the last few distinct decisions of a pool, newest first.

Why: ``lastDecision`` says only what the autoscaler thinks *now*, and
``status.scalingHistory`` only what it *changed*; neither says why a pool sat at 2 replicas
for ten minutes before it scaled (``NoData``, then ``PendingPods``, then ``ScaledUp``).
``kubectl describe sis`` prints the status as it is, so a short per-pool list of decisions
answers that without Prometheus or expired Events.

A decision that repeats every interval (same reason, same from and to, same outcome) is
kept once, with the time it was first made, so a steady pool does not push its history out
and the list is rewritten only when something changed. It rides in the status patch that
writes ``lastDecision`` anyway: no extra API write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..api.status import MAX_RECENT_DECISIONS
from .decision import Decision

IDENTITY_KEYS = ("from", "to", "reason", "applied")
"""Two decisions with equal values here are the same decision repeated."""


def decision_entry(decision: Decision, *, timestamp: str, applied: bool, max_formula_length: int) -> dict[str, Any]:
    """One ``recentDecisions`` item for ``decision``; ``applied`` is whether its replica
    count was written to the Deployment this round."""
    return {
        "time": timestamp,
        "from": decision.current_replicas,
        "to": decision.result,
        "reason": decision.reason,
        "applied": applied,
        "formula": decision.formula[:max_formula_length],
    }


def with_decision(previous: Sequence[Mapping[str, Any]], entry: Mapping[str, Any], *,
                  limit: int = MAX_RECENT_DECISIONS) -> list[dict[str, Any]] | None:
    """The new ``recentDecisions`` list with ``entry`` in front, at most ``limit`` long, or
    None when ``entry`` repeats the newest one (nothing to write)."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if previous and all(previous[0].get(key) == entry.get(key) for key in IDENTITY_KEYS):
        return None
    return [dict(entry), *(dict(e) for e in previous)][:limit]
