"""The inference engine: scheduling, KV block management, model execution and sampling.

Layers talk down only: :mod:`.async_engine` (the server's interface) drives
:mod:`.llm_engine` (the synchronous step loop), which owns :mod:`.scheduler` (continuous
batching over :mod:`.block_manager`) and :mod:`.model_runner` (tensors, model, :mod:`.sampler`).
:mod:`.loading` builds an engine from ``ServeArgs``; :mod:`.null_model` is a compute-free
model for tests and the overhead benchmark.
Import the submodules you need; this package imports torch only through them.
"""

from .errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    EngineDead,
    EngineError,
    PromptExceedsKVCapacity,
    QueueFull,
)
from .outputs import RequestOutput, TokenLogprob
from .sampling_params import SamplingParams

__all__ = [
    "ContextLengthExceeded",
    "DuplicateRequestId",
    "EngineDead",
    "EngineError",
    "PromptExceedsKVCapacity",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
