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

A pool that alternates between decisions that change nothing (at its maximum: an SLO
violation it cannot act on, ``AtMaxReplicas``, ...) would still push its last *change* out of
the short list, leaving no formula for why it has the replicas it has; so the newest applied
change stays, as the list's last item, until a newer change replaces it.
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


def is_applied_change(entry: Mapping[str, Any]) -> bool:
    """A decision whose new replica count was written."""
    return bool(entry.get("applied")) and entry.get("from") != entry.get("to")


def with_decision(
    previous: Sequence[Mapping[str, Any]], entry: Mapping[str, Any], *, limit: int = MAX_RECENT_DECISIONS
) -> list[dict[str, Any]] | None:
    """The new ``recentDecisions`` list with ``entry`` in front, at most ``limit`` long, or
    None when ``entry`` repeats the newest one (nothing to write). When the newest applied
    change would fall off the end, it replaces the last item instead (module docstring)."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if previous and all(previous[0].get(key) == entry.get(key) for key in IDENTITY_KEYS):
        return None
    entries = [dict(entry), *(dict(e) for e in previous)]
    kept = entries[:limit]
    if not any(is_applied_change(e) for e in kept):
        change = next((e for e in entries[limit:] if is_applied_change(e)), None)
        if change is not None:
            kept[-1] = change
    return kept
