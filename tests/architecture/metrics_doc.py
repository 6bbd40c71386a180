"""Writes ``docs/metrics.md``, the metric catalogue, from the names ``splitserve_contract`` defines.

Why generated: the names are defined once, in ``splitserve_contract.metrics`` (the runtime
exports them, the autoscaler, the chart's alerts and dashboards read them); a hand-kept list in
a document drifts from them. The contract is product code and holds names only, so the
catalogue's words (kind, labels, meaning) live here, beside the tool that prints them, and
:func:`render` refuses a contract name without a row, or a row for a name the contract no
longer has. The router's own series are not in the contract (nothing outside the router reads
them); their names are checked against ``splitserve_runtime/router/metrics.py`` instead.

Regenerate after changing a metric::

    python tests/architecture/metrics_doc.py

``tests/architecture/test_metrics_doc.py`` fails while ``docs/metrics.md`` is stale.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from splitserve_contract import Metric, ModelServerMetric, OperatorMetric

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "metrics.md"
ROUTER_METRICS_SOURCE = REPO / "runtime" / "splitserve_runtime" / "router" / "metrics.py"
REGENERATE = "python tests/architecture/metrics_doc.py"


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str  # gauge, counter or histogram
    labels: str  # beyond the section's common labels
    meaning: str


def contract_names(cls: type) -> list[str]:
    """The metric names a contract class defines, in definition order."""
    return [value for key, value in vars(cls).items() if key.isupper() and isinstance(value, str)]


def router_names(source: str) -> list[str]:
    """The ``splitserve_router_*`` series the router's metrics module defines."""
    return list(dict.fromkeys(re.findall(r'"(splitserve_router_[a-z_]+)"', source)))


RUNTIME: Mapping[str, Row] = {
    Metric.REQUESTS_WAITING: Row("gauge", "", "requests queued, not yet scheduled"),
    Metric.REQUESTS_RUNNING: Row("gauge", "", "requests being prefilled or decoded"),
    Metric.PROMPT_TOKENS_WAITING: Row("gauge", "", "uncached prompt tokens queued"),
    Metric.KV_CACHE_USAGE_RATIO: Row(
        "gauge", "", "KV blocks held by live requests / all blocks (cached-but-free blocks count as free)"
    ),
    Metric.KV_CACHE_BLOCKS: Row("gauge", "", "KV blocks in the pool (a gauge, so no `_total`)"),
    Metric.PROMPT_TOKENS_TOTAL: Row("counter", "", "prompt tokens admitted"),
    Metric.GENERATION_TOKENS_TOTAL: Row("counter", "", "tokens generated"),
    Metric.PREFIX_CACHE_QUERIED_TOKENS_TOTAL: Row("counter", "", "prompt tokens looked up in the prefix cache"),
    Metric.PREFIX_CACHE_HIT_TOKENS_TOTAL: Row("counter", "", "prompt tokens found in the prefix cache"),
    Metric.PREEMPTIONS_TOTAL: Row("counter", "", "sequences preempted for lack of KV blocks"),
    Metric.SPEC_DECODE_PROPOSED_TOKENS_TOTAL: Row("counter", "", "speculative proposals verified"),
    Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL: Row(
        "counter",
        "",
        "speculative proposals accepted (accepted / proposed is the acceptance rate; "
        "each accepted proposal is a token without a step of its own)",
    ),
    Metric.SPEC_DECODE_ACCEPTED_TOKENS_BY_POSITION_TOTAL: Row(
        "counter", "`position`", "proposals accepted at that place (0 to `numTokens - 1`) in a step's proposals"
    ),
    Metric.SPEC_DECODE_PROPOSED_TOKENS_BY_POSITION_TOTAL: Row(
        "counter",
        "`position`",
        "proposals verified at that place; accepted / proposed is that position's acceptance rate",
    ),
    Metric.REQUESTS_TOTAL: Row("counter", "`outcome`", "finished requests: `success`, `aborted`, `rejected`, `error`"),
    Metric.KV_TRANSFER_BYTES_TOTAL: Row("counter", "", "KV cache bytes sent or received"),
    Metric.KV_TRANSFER_FAILURES_TOTAL: Row("counter", "", "failed KV transfers"),
    Metric.TIME_TO_FIRST_TOKEN_SECONDS: Row("histogram", "", "arrival to first token"),
    Metric.INTER_TOKEN_LATENCY_SECONDS: Row("histogram", "", "gap between output tokens"),
    Metric.E2E_REQUEST_LATENCY_SECONDS: Row("histogram", "", "arrival to last token"),
    Metric.KV_TRANSFER_SECONDS: Row("histogram", "", "duration of one KV transfer"),
    Metric.ENGINE_STEPS_TOTAL: Row("counter", "", "engine steps run"),
    Metric.ENGINE_STEP_SECONDS_TOTAL: Row(
        "counter",
        "",
        "wall time inside engine steps that ran (scheduling, forward, sampling, outputs; idle time not counted)",
    ),
    Metric.ENGINE_PREFILL_TOKENS_TOTAL: Row(
        "counter", "", "new prompt tokens computed (prefix-cache hits excluded, recompute after preemption included)"
    ),
    Metric.ENGINE_PREFILL_ATTENTION_PAIRS_TOTAL: Row(
        "counter",
        "",
        "causal attention pairs of prefill chunks: `n·c + n(n+1)/2` per chunk of `n` new tokens after `c` computed",
    ),
    Metric.ENGINE_DECODE_ROWS_TOTAL: Row(
        "counter", "", "decoding sequences summed over steps (a speculative verification counts `1 + k` rows)"
    ),
    Metric.ENGINE_DECODE_CONTEXT_TOKENS_TOTAL: Row(
        "counter", "", "KV-cache tokens the decode rows read (their sequences' computed tokens)"
    ),
    Metric.ENGINE_DECODE_ONLY_STEPS_TOTAL: Row("counter", "", "engine steps that computed no prefill chunk"),
    Metric.ENGINE_DECODE_ONLY_STEP_SECONDS_TOTAL: Row(
        "counter", "", "wall time inside the steps that computed no prefill chunk"
    ),
    Metric.ENGINE_DECODE_ONLY_ROWS_TOTAL: Row("counter", "", "decode rows of the steps that computed no prefill chunk"),
    Metric.ENGINE_DECODE_ONLY_CONTEXT_TOKENS_TOTAL: Row(
        "counter", "", "context tokens the decode rows of those steps read"
    ),
}

MODEL_SERVER: Mapping[str, Row] = {
    ModelServerMetric.NUM_REQUESTS_WAITING: Row("gauge", "", "requests waiting to be scheduled"),
    ModelServerMetric.NUM_REQUESTS_RUNNING: Row("gauge", "", "requests being processed"),
    ModelServerMetric.KV_CACHE_USAGE_PERC: Row(
        "gauge", "", "KV cache usage, a fraction 0..1 (as vLLM's, despite the name)"
    ),
    ModelServerMetric.CACHE_CONFIG_INFO: Row(
        "gauge", "`block_size`, `num_gpu_blocks`", "always 1; the labels carry the KV cache's configuration"
    ),
}

OPERATOR: Mapping[str, Row] = {
    OperatorMetric.RECONCILE_SECONDS: Row("histogram", "`outcome`", "time of one InferenceService reconcile"),
    OperatorMetric.RECONCILE_ERRORS_TOTAL: Row("counter", "", "reconciles that ended in a retryable error"),
    OperatorMetric.LEADER: Row("gauge", "", "1 on the replica holding the leader Lease"),
    OperatorMetric.API_REQUESTS_TOTAL: Row(
        "counter",
        "`verb`, `resource`",
        "the operator's own API requests (get, list, create, update, patch, apply); kopf's watches are not counted",
    ),
    OperatorMetric.INFERENCESERVICE_CONDITION: Row(
        "gauge",
        "`namespace`, `inferenceservice`, `type`, `status`, `reason`",
        "1 per condition each InferenceService's status shows now, from the watch",
    ),
    OperatorMetric.AUTOSCALER_DESIRED_REPLICAS: Row(
        "gauge", "`namespace`, `inferenceservice`, `role`", "replicas the autoscaler's last decision asked for"
    ),
    OperatorMetric.AUTOSCALER_READY_REPLICAS: Row(
        "gauge", "`namespace`, `inferenceservice`, `role`", "Ready pods the autoscaler's last decision saw"
    ),
    OperatorMetric.AUTOSCALER_DECISIONS_TOTAL: Row(
        "counter",
        "`namespace`, `inferenceservice`, `role`, `direction`",
        "decisions by `direction`: `up`, `down`, `none`, `hold` (metrics unavailable)",
    ),
}

ROUTER: Mapping[str, Row] = {
    "splitserve_router_requests_total": Row(
        "counter",
        "`outcome`",
        "client requests (`/v1/` routes) answered: `success`, `client_error`, "
        "`upstream_error`, `unavailable`, `internal_error` (the router's own 500)",
    ),
    "splitserve_router_routes_total": Row(
        "counter",
        "`route`",
        "`disaggregated` (prefill then decode), `direct` (a short prompt), `fallback` "
        "(prefill failed), `overflow` (every prefill pod has `spec.router.prefillOverflowTokens` queued)",
    ),
    "splitserve_router_upstream_errors_total": Row("counter", "`upstream`", "failed calls to runtime pods, by role"),
    "splitserve_router_prefill_retries_total": Row("counter", "", "prefill attempts repeated on another pod"),
    "splitserve_router_forward_retries_total": Row(
        "counter",
        "",
        "decode/aggregated sends repeated on another pod after a 503 (draining), a 429 (queue full) "
        "or a server error from a pod that then failed its health poll",
    ),
    "splitserve_router_prefix_queried_blocks_total": Row(
        "counter", "", "leading prompt blocks considered for affinity"
    ),
    "splitserve_router_prefix_matched_blocks_total": Row(
        "counter", "", "leading prompt blocks already routed to the chosen pod (affinity hits)"
    ),
    "splitserve_router_request_seconds": Row(
        "histogram", "", "request to the upstream's response headers or stream end"
    ),
    "splitserve_router_requests_in_flight": Row(
        "gauge", "", "client requests inside the router (a stream until its last byte)"
    ),
    "splitserve_router_upstream_requests_in_flight": Row(
        "gauge", "`pod`", "the router's unfinished requests to each pod"
    ),
    "splitserve_router_healthy_pods": Row(
        "gauge",
        "`upstream`",
        "pods of each role the router sends to now: a Ready pod counts once the "
        "router's health poll has admitted it, so a prompt goes direct to decode until a prefill pod does",
    ),
}


@dataclasses.dataclass(frozen=True)
class Section:
    title: str
    intro: str
    names: Sequence[str]
    rows: Mapping[str, Row]


def sections(*, router_source: str) -> list[Section]:
    return [
        Section(
            "Runtime",
            "Exported by every prefill, decode and aggregated pod at `/metrics` "
            "(`splitserve_contract.Metric`). Labels `role` and `model` on every series.",
            contract_names(Metric),
            RUNTIME,
        ),
        Section(
            "Model-server protocol",
            "The same pods, under vLLM's names with the label `model_name`, so a "
            "Gateway API Inference Extension endpoint picker reads splitserve pods with its defaults "
            "(`splitserve_contract.ModelServerMetric`).",
            contract_names(ModelServerMetric),
            MODEL_SERVER,
        ),
        Section(
            "Router",
            'Exported by the router (`role="router"`, and `model`); defined in '
            "`splitserve_runtime/router/metrics.py`, read by nothing else in the project.",
            router_names(router_source),
            ROUTER,
        ),
        Section(
            "Operator",
            "Exported by the operator replica (`splitserve_contract.OperatorMetric`).",
            contract_names(OperatorMetric),
            OPERATOR,
        ),
    ]


HEADER = f"""# Metrics

<!-- Generated by `{REGENERATE}` from the names in `splitserve_contract`; do not edit. -->

Every runtime and router series carries `role` and `model`; Prometheus adds `namespace`, `pod`
and `inferenceservice` from pod labels (the chart's PodMonitor, or the annotation-based scrape
config). The autoscaler pins every query to those three (`docs/architecture.md`, "Metrics").

The engine-step counters (`splitserve_engine_*_total`) feed the SLO autoscaler's step model:
their increases over a window of one pod are one exact regression point of
`seconds = step·steps + prefill_token·prefill_tokens + prefill_pair·pairs + decode_row·rows +
decode_context·context`; the decode-only ones split the window into two points with different
mixes, because on an aggregated pod prefill and decode work grow together. With asynchronous
scheduling a step is timed by the `step()` call that returns its tokens.
"""


def render(*, router_source: str | None = None) -> str:
    """The whole of ``docs/metrics.md``. Raises :class:`ValueError` when a defined name has no row
    or a row names a series that is not defined."""
    source = ROUTER_METRICS_SOURCE.read_text() if router_source is None else router_source
    parts = [HEADER]
    problems: list[str] = []
    for section in sections(router_source=source):
        missing = [name for name in section.names if name not in section.rows]
        stale = [name for name in section.rows if name not in section.names]
        problems += [f"{section.title}: no row for {name}" for name in missing]
        problems += [f"{section.title}: row for undefined {name}" for name in stale]
        parts.append(
            f"\n## {section.title}\n\n{section.intro}\n\n| name | kind | labels | meaning |\n| --- | --- | --- | --- |\n"
        )
        for name in section.names:
            row = section.rows.get(name)
            if row is not None:
                parts.append(f"| `{name}` | {row.kind} | {row.labels} | {row.meaning} |\n")
    if problems:
        raise ValueError("; ".join(problems))
    return "".join(parts)


def main() -> int:
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
