"""How long one engine step takes, and how many KV tokens a pod holds: the roofline model.

An engine step runs a batch of new tokens (prefill chunks and one token per decoding
sequence) through the model once. :class:`StepCost` is the interface the simulator uses;
two implementations exist: :class:`RooflineModel` here (from a model shape and GPU specs) and
:class:`~.profile.ProfileModel` (fitted to measured timings of our runtime).

Roofline, per GPU of a tensor-parallel group of ``tp`` (the rank with the largest share):

* the matmuls (GEMMs): ``2 · linear_params · tokens`` FLOPs at the linear layers' tensor-core
  rate (bf16, or FP8/INT8 for W8A8 quantization) plus the LM head's for each sampled sequence
  at the activation dtype's, over ``compute_efficiency``; or the weight bytes over
  ``HBM bandwidth × bandwidth_efficiency``, whichever is larger;
* attention: ``4 · layers · q_size · attention_pairs`` FLOPs at the activation dtype's rate, or
  the KV bytes read and written, whichever is larger;
* the step is the *sum* of the two (they are separate kernels, run one after the other: the KV
  reads of the decodes in a mixed batch do not hide under the prefill's GEMM compute), plus a
  fixed per-step overhead and, for ``tp > 1``, the collectives (:meth:`RooflineModel.communication_seconds`).
  Pure prefill is compute-bound, pure decode memory-bound, as in the one-roofline-per-step form.

Tensor parallelism splits as the runtime does (:mod:`splitserve_runtime.model.tensor_parallel`):
heads by KV group, unevenly when the KV heads do not divide (the rank with the most groups sets
the pace and the KV capacity), each KV head replicated when there are fewer than ``tp``; the MLP's
intermediate features evenly (they must divide); the embedding and LM head by vocabulary rows.
Each step then runs ``2 · layers + 1`` ring all-reduces of ``tokens × hidden × activation bytes``
(after the attention output and the MLP down projections, and the vocabulary-parallel embedding),
each moving ``2 (tp − 1) / tp`` of its payload over ``interconnect_bytes_per_second`` plus a
fixed latency, and one all-gather of the fp32 logits of every sampled row.

``attention_pairs`` counts (query, key) pairs: a decode of a sequence with ``c`` tokens is ``c``
pairs; a prefill chunk of ``n`` new tokens after ``c`` computed ones is ``n·c + n(n+1)/2``.
KV capacity is ``(memory × memory_fraction − weights − activation reserve) / KV bytes per token``.

Bytes come from :class:`~.precision.Precision`: linear-layer weights at the quantization's bytes
per parameter, embeddings and the LM head at the activation dtype's, KV at the KV cache dtype's,
all-reduce payloads at the activation dtype's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from splitserve_contract import defaults
from splitserve_contract.model_config import ModelConfig

from .gpus import GIB, GpuSpec
from .precision import Precision
from .supported import known_tensor_parallel_sizes, remedies

ALL_REDUCE_LATENCY_SECONDS = 8e-6
"""Fixed cost of one small all-reduce over NVLink (NCCL, latency-bound at decode sizes)."""
LOGIT_BYTES = 4
"""The runtime computes logits in fp32 (``compute_logits``), so the LM head's all-gather ships 4 bytes each."""


MIN_KV_TOKENS = 4096
"""A pod whose KV cache holds fewer tokens than this is not worth planning with."""


class ModelDoesNotFit(ValueError):
    """The weights (plus reserve) leave no room for KV cache on one GPU at this TP."""


class TensorParallelRefused(ValueError):
    """The runtime would refuse this model at this TP size: its heads or MLP cannot be split
    that many ways."""


def prefill_attention_pairs(*, num_new_tokens: int, num_computed_tokens: int) -> int:
    """(query, key) pairs of a causal prefill chunk (see the module docstring)."""
    return num_new_tokens * num_computed_tokens + num_new_tokens * (num_new_tokens + 1) // 2


class StepCost(Protocol):
    """What the simulator needs from a performance model."""

    @property
    def name(self) -> str: ...

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens one pod holds."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """Whole model (all layers, all TP shards): what a KV transfer ships per token."""
        ...

    def step_seconds(self, *, num_tokens: int, num_seqs: int, num_attention_pairs: int, num_kv_tokens: int) -> float:
        """Duration of one step: ``num_tokens`` new tokens over ``num_seqs`` sequences that
        already hold ``num_kv_tokens`` KV tokens in total, with ``num_attention_pairs`` pairs."""
        ...


def prefill_seconds(model: StepCost, *, num_tokens: int, num_cached_tokens: int = 0) -> float:
    """One sequence's whole prompt in one step (no chunking), ``num_cached_tokens`` cached."""
    new = num_tokens - num_cached_tokens
    return model.step_seconds(
        num_tokens=new,
        num_seqs=1,
        num_kv_tokens=num_cached_tokens,
        num_attention_pairs=prefill_attention_pairs(num_new_tokens=new, num_computed_tokens=num_cached_tokens),
    )


def decode_step_seconds(model: StepCost, *, batch_size: int, num_context_tokens: int) -> float:
    """One decode step of ``batch_size`` sequences holding ``num_context_tokens`` in total."""
    return model.step_seconds(
        num_tokens=batch_size,
        num_seqs=batch_size,
        num_attention_pairs=num_context_tokens + batch_size,
        num_kv_tokens=num_context_tokens,
    )


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Parameter and byte counts derived from a :class:`ModelConfig`."""

    num_layers: int
    q_size: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    linear_params: int
    """Per-token matmul parameters in the transformer layers (attention + MLP)."""
    lm_head_params: int
    embedding_params: int
    tied: bool
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> ModelShape:
        h = config.hidden_size
        attention = h * config.q_size + 2 * h * config.kv_size + config.q_size * h
        mlp = 3 * h * config.intermediate_size
        return cls(
            num_layers=config.num_hidden_layers,
            q_size=config.q_size,
            hidden_size=h,
            num_heads=config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            linear_params=config.num_hidden_layers * (attention + mlp),
            lm_head_params=config.vocab_size * h,
            embedding_params=config.vocab_size * h,
            tied=config.tie_word_embeddings,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
        )

    @property
    def total_params(self) -> int:
        return self.linear_params + self.embedding_params + (0 if self.tied else self.lm_head_params)

    @property
    def dense_params(self) -> int:
        """Parameters every method keeps in the activation dtype: embeddings and LM head."""
        return self.total_params - self.linear_params

    def weight_bytes(self, precision: Precision) -> int:
        """All weights, whole model (quantized linear layers, dense embeddings and LM head)."""
        return (
            round(self.linear_params * precision.linear_weight_bytes) + self.dense_params * precision.activation_bytes
        )

    def kv_bytes_per_token(self, precision: Precision, *, kv_heads: int | None = None) -> int:
        """K and V of every layer for one token (``kv_heads``: those one GPU holds)."""
        heads = self.kv_heads if kv_heads is None else kv_heads
        return 2 * self.num_layers * heads * self.head_dim * precision.kv_bytes_per_element

    # ------------------------------------------------------------------ tensor parallelism
    def split_problems(self, tp: int) -> list[str]:
        """Why the runtime cannot split this shape ``tp`` ways (empty: it can); the runtime's
        ``check_divisible`` in :mod:`splitserve_runtime.model.tensor_parallel`, same words."""
        kv, group = self.kv_heads, self.num_heads // self.kv_heads
        problems = []
        if kv < tp and (tp % kv or group % (tp // kv)):
            problems.append(f"{kv} KV heads with {group} query heads each cannot be replicated evenly")
        if self.intermediate_size % tp:
            problems.append(f"the intermediate size {self.intermediate_size} is not divisible")
        return problems

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads of the rank holding the most: whole groups, or one replicated head."""
        return 1 if self.kv_heads < tp else -(-self.kv_heads // tp)

    def q_heads_per_gpu(self, tp: int) -> int:
        """Query heads of the rank holding the most (its KV groups' heads, or its share of one)."""
        replicas = max(1, tp // self.kv_heads)
        return self.kv_heads_per_gpu(tp) * (self.num_heads // self.kv_heads) // replicas

    def linear_params_per_gpu(self, tp: int) -> int:
        """Matmul parameters of the transformer layers on the rank holding the most."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.q_heads_per_gpu(tp) * d, self.kv_heads_per_gpu(tp) * d
        return self.num_layers * (2 * h * q + 2 * h * kv + 3 * h * (self.intermediate_size // tp))

    def vocab_rows_per_gpu(self, tp: int) -> int:
        """Embedding and LM-head rows per rank (the vocabulary is padded to a multiple of ``tp``)."""
        return -(-self.vocab_size // tp)

    def weight_bytes_per_gpu(self, precision: Precision, tp: int) -> int:
        """:meth:`weight_bytes` of the rank holding the most (equal to it at ``tp`` 1)."""
        dense = self.vocab_rows_per_gpu(tp) * self.hidden_size * (1 if self.tied else 2)
        return (
            round(self.linear_params_per_gpu(tp) * precision.linear_weight_bytes) + dense * precision.activation_bytes
        )


@dataclass(frozen=True, kw_only=True)
class RooflineModel:
    """The roofline :class:`StepCost` for one (model, GPU, TP, precision) pod."""

    name: str
    shape: ModelShape
    gpu: GpuSpec
    tensor_parallel: int
    precision: Precision
    memory_fraction: float = defaults.KV_MEMORY_FRACTION
    activation_reserve_bytes: int = 4 * GIB
    compute_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    step_overhead_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel not in known_tensor_parallel_sizes():
            sizes = ", ".join(str(v) for v in known_tensor_parallel_sizes())
            raise ValueError(f"tensor parallel size must be one of {sizes}, got {self.tensor_parallel}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory fraction must be in (0, 1], got {self.memory_fraction}")
        problems = self.shape.split_problems(self.tensor_parallel)
        if problems:
            raise TensorParallelRefused(
                f"{self.name}: tensor-parallel size {self.tensor_parallel} does not fit the "
                f"model: {'; '.join(problems)}"
            )
        self.precision.check_gpu(self.gpu)  # fp8 on a GPU without FP8: ValueError
        if self.kv_capacity_tokens < MIN_KV_TOKENS:
            raise ModelDoesNotFit(self.fit_message(min_kv_tokens=MIN_KV_TOKENS))

    # ------------------------------------------------------------------ memory
    @property
    def dtype(self) -> str:
        """The activation dtype."""
        return self.precision.dtype

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.shape.weight_bytes_per_gpu(self.precision, self.tensor_parallel)

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Per GPU: every matmul weight once (embeddings are only gathered)."""
        tp = self.tensor_parallel
        linear = round(self.shape.linear_params_per_gpu(tp) * self.precision.linear_weight_bytes)
        return linear + self.shape.vocab_rows_per_gpu(tp) * self.shape.hidden_size * self.precision.activation_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token(self.precision)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self.shape.kv_bytes_per_token(self.precision, kv_heads=self.shape.kv_heads_per_gpu(self.tensor_parallel))

    @property
    def kv_budget_bytes_per_gpu(self) -> int:
        return (
            int(self.gpu.memory_bytes * self.memory_fraction)
            - self.weight_bytes_per_gpu
            - self.activation_reserve_bytes
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return max(0, self.kv_budget_bytes_per_gpu // self.kv_bytes_per_token_per_gpu)

    def fit_message(self, *, min_kv_tokens: int = 0) -> str:
        need = (
            self.weight_bytes_per_gpu + self.activation_reserve_bytes + min_kv_tokens * self.kv_bytes_per_token_per_gpu
        )
        need_total = need / self.memory_fraction
        return (
            f"{self.name} ({self.precision.label}) needs {need_total / GIB:.1f} GiB per GPU at TP={self.tensor_parallel} "
            f"(weights {self.weight_bytes_per_gpu / GIB:.1f} GiB + reserve {self.activation_reserve_bytes / GIB:.1f} GiB"
            f" + KV for {min_kv_tokens} tokens {min_kv_tokens * self.kv_bytes_per_token_per_gpu / GIB:.1f} GiB,"
            f" at memory fraction {self.memory_fraction:g}); {self.gpu.name} has "
            f"{self.gpu.memory_bytes / GIB:.1f} GiB ({self.gpu.memory_bytes / 1e9:.0f} GB): "
            f"use {remedies(tensor_parallel=self.tensor_parallel, precision=self.precision, gpu=self.gpu)}"
        )

    # ------------------------------------------------------------------ time
    @property
    def all_reduces_per_step(self) -> int:
        """Ring all-reduces of the activations per step: two per layer and the embedding's (0 at TP 1)."""
        return 0 if self.tensor_parallel == 1 else 2 * self.shape.num_layers + 1

    def _communication(self) -> tuple[float, float, float]:
        """(fixed, per new token, per sampled row) seconds of a step's collectives."""
        tp, gpu = self.tensor_parallel, self.gpu
        if tp == 1:
            return 0.0, 0.0, 0.0
        ring = 2.0 * (tp - 1) / tp  # each GPU sends and receives this share of an all-reduce payload
        per_token = (
            self.all_reduces_per_step
            * ring
            * self.shape.hidden_size
            * self.precision.activation_bytes
            / gpu.interconnect_bytes_per_second
        )
        # the LM head's vocabulary slices: each rank receives the other ranks' fp32 logits
        per_row = (tp - 1) * self.shape.vocab_rows_per_gpu(tp) * LOGIT_BYTES / gpu.interconnect_bytes_per_second
        return (self.all_reduces_per_step + 1) * ALL_REDUCE_LATENCY_SECONDS, per_token, per_row

    def communication_seconds(self, *, num_tokens: int, num_seqs: int) -> float:
        """The part of :meth:`step_seconds` spent in tensor-parallel collectives (0 at TP 1)."""
        fixed, per_token, per_row = self._communication()
        return fixed + per_token * num_tokens + per_row * num_seqs

    def _coefficients(self) -> tuple[float, float, float, float, float, float, float, float]:
        """Per-step constants, computed once (the simulator calls step_seconds millions of times)."""
        gpu, tp, shape = self.gpu, self.tensor_parallel, self.shape
        ce = self.compute_efficiency if self.compute_efficiency is not None else gpu.compute_efficiency
        be = self.bandwidth_efficiency if self.bandwidth_efficiency is not None else gpu.bandwidth_efficiency
        overhead = self.step_overhead_seconds if self.step_overhead_seconds is not None else gpu.step_overhead_seconds
        linear_rate = self.precision.linear_ops_per_second(gpu) * ce
        flop_rate = self.precision.activation_flops_per_second(gpu) * ce
        byte_rate = gpu.hbm_bytes_per_second * be
        comm_fixed, comm_per_token, comm_per_row = self._communication()
        return (
            2.0 * shape.linear_params_per_gpu(tp) / linear_rate,
            4.0 * shape.num_layers * shape.q_heads_per_gpu(tp) * shape.head_dim / flop_rate,
            2.0 * shape.vocab_rows_per_gpu(tp) * shape.hidden_size / flop_rate,
            self.weight_bytes_read_per_step / byte_rate,
            self.kv_bytes_per_token_per_gpu / byte_rate,
            overhead + comm_fixed,
            comm_per_token,
            comm_per_row,
        )

    def step_seconds(self, *, num_tokens: int, num_seqs: int, num_attention_pairs: int, num_kv_tokens: int) -> float:
        coef = self.__dict__.get("_coef")
        if coef is None:
            coef = self._coefficients()
            object.__setattr__(self, "_coef", coef)
        tok, pair, seq, weights, kv, fixed, comm_token, comm_row = coef
        linear = tok * num_tokens + seq * num_seqs  # the GEMMs read every weight once per step
        attention = pair * num_attention_pairs  # attention reads every held KV token once
        kv_read = kv * (num_kv_tokens + num_tokens)
        return (
            (linear if linear > weights else weights)
            + (attention if attention > kv_read else kv_read)
            + fixed
            + comm_token * num_tokens
            + comm_row * num_seqs
        )


def roofline_model(
    *,
    name: str,
    config: ModelConfig,
    gpu: GpuSpec,
    tensor_parallel: int,
    dtype: str,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    memory_fraction: float = defaults.KV_MEMORY_FRACTION,
    compute_efficiency: float | None = None,
    bandwidth_efficiency: float | None = None,
    step_overhead_seconds: float | None = None,
) -> RooflineModel:
    """Build the roofline for ``config`` on ``gpu`` (raises :class:`ModelDoesNotFit`, :class:`TensorParallelRefused`, ValueError).

    ``dtype`` is the activation dtype (``fp8``: the legacy alias for bf16 with fp8 weights)."""
    precision = Precision.of(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return RooflineModel(
        name=name,
        shape=ModelShape.from_config(config),
        gpu=gpu,
        tensor_parallel=tensor_parallel,
        precision=precision,
        memory_fraction=memory_fraction,
        compute_efficiency=compute_efficiency,
        bandwidth_efficiency=bandwidth_efficiency,
        step_overhead_seconds=step_overhead_seconds,
    )


def max_decode_batch(model: StepCost, *, itl_seconds: float, mean_context_tokens: float, max_num_seqs: int) -> int:
    """Largest decode batch whose step stays within ``itl_seconds`` and whose KV fits (0: none)."""
    best = 0
    kv_limit = int(model.kv_capacity_tokens // max(mean_context_tokens, 1.0))
    for batch in range(1, min(max_num_seqs, kv_limit) + 1):
        ctx = int(math.ceil(batch * mean_context_tokens))
        if decode_step_seconds(model, batch_size=batch, num_context_tokens=ctx) > itl_seconds:
            break
        best = batch
    return best
