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
SHORT_PROMPT_THRESHOLD: Final = 64
"""Prompts with fewer uncached tokens go straight to decode."""
DRAIN_TIMEOUT_SECONDS: Final = 30.0
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
