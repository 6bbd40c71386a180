"""Shared defaults: one value each, used by the API (CRD defaults), the runtime's flags, the
router, the planner and the autoscaler. Change a value here and every side follows.
"""

from __future__ import annotations

from typing import Final

BLOCK_SIZE: Final = 16
"""Tokens per KV cache block (part of the compat hash)."""
BLOCK_SIZES: Final = (8, 16, 32, 64, 128)
"""Block sizes the API accepts and the kernels are tested with."""
KV_MEMORY_FRACTION: Final = 0.9
"""Fraction of free device memory, measured at start-up, given to the KV cache."""
MAX_NUM_SEQS: Final = 256
MAX_NUM_BATCHED_TOKENS: Final = 8192
MAX_QUEUE_LEN: Final = 1024
MAX_REQUEST_BODY_BYTES: Final = 8 * 1024 * 1024
"""Largest HTTP request body the runtime and the router read (413 above; 0: no limit)."""
HEADER_TIMEOUT_SECONDS: Final = 30.0
"""Time a client has to send a request's line and headers, from its first byte (or from the
connection's start); the runtime's and the router's HTTP servers close it after (0: no bound)."""
BODY_IDLE_TIMEOUT_SECONDS: Final = 60.0
"""Longest pause between the bytes of a request body the runtime and the router wait through
(408 and close after; 0: no bound)."""
SHORT_PROMPT_THRESHOLD: Final = 64
"""Prompts with fewer uncached tokens go straight to decode."""
DRAIN_TIMEOUT_SECONDS: Final = 30.0
ENGINE_STEP_TIMEOUT_SECONDS: Final = 300.0
"""Longest one engine iteration (a model step, with every tensor- or pipeline-parallel rank)
may run before the runtime declares the engine wedged: ``/health`` answers 503 (the kubelet
restarts the pod) and in-flight requests end with ``engine_dead``. A step is one forward of at
most ``--max-num-batched-tokens`` tokens, well under a minute even on a cold first step that
compiles its kernels; half of gloo's 10-minute collective timeout, so a stopped rank is noticed
long before the collective gives up (0: no watchdog)."""
PREFILL_TIMEOUT_SECONDS: Final = 30.0
"""Total time the prefill request of a disaggregated request may take (the router's, and a
decode pod's that a picker header sent to a prefill pod, the identity check included), from the
first connect to the last byte of the answer: a drip of bytes does not extend it. After it the
decode pod computes the prompt itself (route "fallback", a failed KV transfer), so a prefill pod
that accepts and never answers, or drips, costs each request this much instead of the upstream
bound of 600 s. A prefill request is one forward pass over the prompt: even a full
``MAX_NUM_BATCHED_TOKENS`` step queue of a busy pod (1024 waiting requests in 8192-token steps
of well under 100 ms on a GPU) clears in seconds, so 30 s is only reached by a pod that is not
serving; past it, computing the prompt on the decode pod is also the faster answer. It is not
scaled with the prompt: ``max_model_len`` bounds one prompt's pass to well under it."""
KV_TTL_SECONDS: Final = 30.0
ROUTER_HEALTH_INTERVAL_SECONDS: Final = 2.0
SESSION_HEADER: Final = "x-session-id"

AUTOSCALING_INTERVAL: Final = "15s"
"""Time between autoscaling decisions of one InferenceService (spec.autoscaling.interval)."""
AUTOSCALER_BASE_TICK_SECONDS: Final = 5.0
"""How often the operator-wide autoscaler loop wakes to see whose interval is due."""
SCRAPE_INTERVAL_SECONDS: Final = 15.0
"""Prometheus scrape interval the autoscaler assumes (operator flag, chart value)."""
SIGNAL_WINDOW_SECONDS: Final = 30.0
"""Range the autoscaler averages each signal over."""

SLO_MAX_COEFFICIENT_SECONDS: Final = 60.0
"""The largest step-model coefficient (seconds per unit: step, prompt token, causal pair,
decoding row, context token) an SLO prior may have, and the bound the autoscaler takes any prior
at: no engine spends a minute on one step, token, pair or row, and the fit's arithmetic (the
prior's pull is its precision, up to ~10²⁷, times the coefficient) stays finite below it. A
prior of 1e308 otherwise turned the fitted coefficients, the estimates and the status the API
server is sent into Infinity."""
