"""A draft model that proposes its greedy continuation (``--speculative-method draft``).

The draft is a smaller model with the target's vocabulary, loaded in the same process, with
its own paged KV cache laid over the *target's* blocks: the same block ids and slots, other
tensors (so the scheduler's block tables, allocation and preemption serve both models). Its
proposals are greedy, a deterministic function of the tokens so far, so the engine's
verification rule stays exact and a seeded request's tokens equal plain sampling's (see
:mod:`.speculative`); sampled proposals would give both up.

The draft's KV is filled lazily: :attr:`~.sequence.Sequence.num_draft_computed` counts the
leading positions whose draft K/V is valid, and each proposal first runs the draft over the
positions it is missing (the prompt on first use, an imported prefill on a decode pod, prefix-
cache hits, tokens after a preemption's recompute) as one extend chunk whose last row gives the
first proposal; each further proposal is one batched decode step. After verification only the
positions holding accepted tokens stay counted, so rejected proposals' slots are recomputed.
"""

from __future__ import annotations

import dataclasses

import torch

from .kv_budget import KVCacheSpec
from .model_runner import allocate_kv_caches
from .sequence import Sequence
from .step_inputs import CausalLM, DecodeRow, KVCaches, PrefillRow, build_step_inputs


@dataclasses.dataclass
class DraftModel:
    """The draft model and its KV cache (``num_blocks`` blocks of ``block_size``, like the target's)."""

    model: CausalLM
    spec: KVCacheSpec
    device: torch.device
    block_size: int
    num_blocks: int
    kv_caches: KVCaches = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.kv_caches = allocate_kv_caches(
            spec=self.spec, num_blocks=self.num_blocks, block_size=self.block_size, device=self.device
        )

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Greedy continuations of ``lengths[i]`` tokens for each sequence (whose last token is
        uncomputed, and whose blocks hold slots for ``lengths[i]`` more positions)."""
        if not seqs:
            return []
        # 1. catch up on missing positions and take the first proposal from the last row
        rows = [
            PrefillRow(
                token_ids=seq.token_ids[seq.num_draft_computed :],
                start_position=seq.num_draft_computed,
                block_table=seq.block_table,
            )
            for seq in seqs
        ]
        proposals = [[token] for token in self._run(prefills=rows, decodes=[])]
        for seq in seqs:
            seq.num_draft_computed = seq.num_tokens
        # 2. one batched decode step per further proposal
        for step in range(1, max(lengths)):
            active = [i for i, n in enumerate(lengths) if n > step]
            decodes = [
                DecodeRow(
                    token_id=proposals[i][-1], position=seqs[i].num_tokens - 1 + step, block_table=seqs[i].block_table
                )
                for i in active
            ]
            for i, token in zip(active, self._run(prefills=[], decodes=decodes), strict=True):
                proposals[i].append(token)
        return proposals

    def _run(self, *, prefills: list[PrefillRow], decodes: list[DecodeRow]) -> list[int]:
        inputs = build_step_inputs(
            prefills=prefills,
            decodes=decodes,
            sample_prefill=[1] * len(prefills),
            block_size=self.block_size,
            device=self.device,
        )
        hidden = self.model.forward(
            input_ids=inputs.input_ids, positions=inputs.positions, kv_caches=self.kv_caches, md=inputs.md
        )
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens: list[int] = logits.argmax(dim=-1).tolist()
        return tokens

    @staticmethod
    def after_verification(seq: Sequence, *, num_proposed: int, num_accepted: int) -> None:
        """Keep counted only the draft positions that hold accepted tokens: it wrote positions
        ``n - 1 .. n + num_proposed - 2`` (its inputs: the last token and its proposals but the last)."""
        n_before = seq.num_tokens  # called before the accepted tokens are appended
        seq.num_draft_computed = n_before - 1 + min(num_proposed, num_accepted + 1)
