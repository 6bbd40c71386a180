"""Engine settings after resolution: the subset of ``ServeArgs`` the engine loop uses.

``ServeArgs`` is the command line; :class:`EngineConfig` is what remains once the model is
known (``max_model_len`` resolved against the model's limit, the KV pool measured). It is
validated here so that a bad flag fails start-up with a message, not a request later.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_contract import ServeArgs, defaults


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_model_len: int
    block_size: int = defaults.BLOCK_SIZE
    num_kv_blocks: int = 0
    """0: measure at start-up."""
    kv_memory_fraction: float = defaults.KV_MEMORY_FRACTION
    prefix_caching: bool = True
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    chunked_prefill: bool = True
    max_queue_len: int = defaults.MAX_QUEUE_LEN
    seed: int = 0
    async_scheduling: bool | None = None
    """Schedule step n+1 while step n runs (:mod:`.step_overlap`). None (the default): off,
    for the reasons in :mod:`.step_overlap`; True: on, an error with speculative decoding or
    tensor / pipeline parallelism."""
    cuda_graphs: bool = False
    """Replay pure-decode steps of up to ``max_num_seqs`` rows (at most 512) from CUDA graphs,
    one per batch-size bucket (:mod:`.cuda_graphs`). Off by default until a GPU run shows them correct
    and faster; on: an error off CUDA, with the torch attention backend, with tensor / pipeline
    parallelism or with asynchronous scheduling."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole sequence must fit in one step: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}); enable chunked prefill or lower max_model_len"
            )
        if self.cuda_graphs and self.async_scheduling:
            raise ValueError(
                "CUDA graphs do not cover asynchronous scheduling yet: its steps build "
                "their inputs outside the model runner; turn one of them off"
            )

    @classmethod
    def from_serve_args(cls, args: ServeArgs, *, max_model_len: int) -> EngineConfig:
        if args.cuda_graphs and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1):
            raise ValueError(
                "--cuda-graphs is not available with tensor or pipeline parallelism yet "
                "(the ranks' forwards run eagerly); drop one of them"
            )
        return cls(
            max_model_len=max_model_len,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_memory_fraction=args.kv_memory_fraction,
            prefix_caching=args.prefix_caching,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill=args.chunked_prefill,
            max_queue_len=args.max_queue_len,
            seed=args.seed,
            cuda_graphs=args.cuda_graphs,
        )
