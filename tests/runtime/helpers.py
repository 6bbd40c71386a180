"""Test-only drivers: :func:`run_to_completion` for an engine, and :class:`PagedRunner` for the
model over a paged KV cache (the engine builds the real metadata).

:class:`PagedRunner` owns per-layer K/V caches, hands out blocks in a scrambled order (so a
wrong block-table lookup shows up as wrong logits), tracks each sequence's cached length and
builds :class:`AttentionMetadata` for one step of prefill/extend chunks plus decode rows.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.model.llama import LlamaForCausalLM
from splitserve_runtime.ops.interface import AttentionMetadata

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (bench scripts are not a package); registered in
    ``sys.modules`` first, so its dataclasses resolve their module by name."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_to_completion(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams, *, max_steps: int = 5000
) -> dict[str, list[int]]:
    """Add every prompt (request id → token ids) and step until all finish; each request's tokens."""
    for rid, prompt in prompts.items():
        engine.add_request(request_id=rid, prompt_token_ids=prompt, params=params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for step in engine.step():
            out[step.request_id].extend(step.new_token_ids)
    raise AssertionError("engine did not finish")


@dataclass
class _SeqState:
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


class PagedRunner:
    """Drive ``model`` step by step; sequences are named by any hashable id."""

    def __init__(
        self,
        *,
        model: LlamaForCausalLM,
        num_blocks: int = 64,
        block_size: int = 4,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        # Scrambled but deterministic allocation order: odd blocks downwards, then even ones.
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b % 2] + [b for b in range(num_blocks) if b % 2 == 0]
        self.seqs: dict[object, _SeqState] = {}

    def _slots_for(self, seq: _SeqState, num_new_tokens: int) -> list[int]:
        slots = []
        for pos in range(seq.num_cached_tokens, seq.num_cached_tokens + num_new_tokens):
            if pos // self.block_size >= len(seq.block_ids):
                seq.block_ids.append(self._free.pop(0))
            slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
        return slots

    def _block_table(self, states: list[_SeqState]) -> torch.Tensor:
        width = max([len(s.block_ids) for s in states] + [1])
        rows = [s.block_ids + [0] * (width - len(s.block_ids)) for s in states]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(states), width)

    def step(
        self,
        *,
        prefills: list[tuple[object, list[int]]],
        decodes: list[tuple[object, int]],
    ) -> torch.Tensor:
        """Run one step; return fp32 logits, one row per input token (prefill rows first)."""
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        prefill_states: list[_SeqState] = []
        for seq_id, tokens in prefills:
            seq = self.seqs.setdefault(seq_id, _SeqState())
            slots += self._slots_for(seq, len(tokens))
            positions += list(range(seq.num_cached_tokens, seq.num_cached_tokens + len(tokens)))
            input_ids += tokens
            seq.num_cached_tokens += len(tokens)
            cu.append(cu[-1] + len(tokens))
            prefill_states.append(seq)
        decode_states: list[_SeqState] = []
        for seq_id, token in decodes:
            seq = self.seqs[seq_id]
            slots += self._slots_for(seq, 1)
            positions.append(seq.num_cached_tokens)
            input_ids.append(token)
            seq.num_cached_tokens += 1
            decode_states.append(seq)
        prefill_lens = [s.num_cached_tokens for s in prefill_states]
        decode_lens = [s.num_cached_tokens for s in decode_states]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_prefills=len(prefills),
            num_prefill_tokens=cu[-1],
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
            prefill_block_tables=self._block_table(prefill_states).to(device),
            prefill_max_q_len=max([len(t) for _, t in prefills] + [0]),
            prefill_max_context_len=max(prefill_lens + [0]),
            num_decodes=len(decodes),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
            decode_block_tables=self._block_table(decode_states).to(device),
            decode_max_context_len=max(decode_lens + [0]),
            block_size=self.block_size,
        )
        hidden = self.model(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            kv_caches=self.kv_caches,
            md=md,
        )
        return self.model.compute_logits(hidden)

    def greedy(self, *, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Batched greedy generation: one prefill step for all prompts, then decode steps."""
        logits = self.step(prefills=[(i, p) for i, p in enumerate(prompts)], decodes=[])
        ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
        outputs = [[int(t)] for t in logits[ends].argmax(-1)]
        for _ in range(max_new_tokens - 1):
            logits = self.step(prefills=[], decodes=[(i, out[-1]) for i, out in enumerate(outputs)])
            for out, token in zip(outputs, logits.argmax(-1), strict=True):
                out.append(int(token))
        return outputs
