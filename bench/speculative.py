"""Speculative decoding (n-gram proposals) on a real model on the CPU: acceptance, tokens per
target forward, exactness, and end-to-end inter-token latency with and without it.

Model: SmolLM2-135M-Instruct (:mod:`splitserve_e2e.smollm2`), served from its fp32 HF
directory (``hf_dir()``, the Q4_1 GGUF dequantized once) on the torch backend: the dense fp32
GEMMs are the fastest path on a CPU, and speculation does not depend on the weight format.
``--threads`` torch threads (default 1: on a shared 2-core machine a second thread waits for
whatever else runs and wall times swing 3x between identical runs; with one thread the process
keeps a core, and the process CPU time, reported next to wall time, is barely affected by other
tenants. One thread makes extra rows dearer than with all cores, so CPU speculation looks
somewhat worse than on an idle multi-core host).

Two prompt sets of 16 chat prompts, each rendered with the model's chat template, greedy,
at most ``--new-tokens`` new tokens (eos ends a request, as in production):

- **repetitive**: the answer repeats the prompt (rewrite a function with type hints, a list
  reversed, a paragraph quoted back with one change, JSON to YAML, ...), where prompt lookup
  finds its proposals;
- **open-ended**: stories and explanations, where it rarely does.

Settings: ``off`` (``--speculative-method none``), ``ngram k=K`` for each ``--ks`` with the
runtime's default ``--speculative-max-num-seqs`` (16: at a larger batch only the steps after
enough requests finished speculate), and, at batches above 16, ``ngram k=K lim=B`` for the
first K with the limit raised to the batch, so every step speculates.

Per (prompt set, batch, setting) the same requests run with ``B`` concurrent sequences
(batch 1: the first ``--batch1-prompts`` prompts one at a time; a batch above the set's size
repeats its prompts). Reported:

- **acceptance** (at the largest batch <= 16 that covers each prompt once): accepted /
  proposed; by position, the share of verifications proposing at least ``i + 1`` tokens that
  accepted at least ``i + 1``; decode tokens per target forward per sequence (decode tokens /
  forwards the sequence took part in); the fraction of forwards that carried proposals; and
  ``a_fit``, the per-position acceptance of the i.i.d. model (Leviathan et al. 2023) whose
  ``(1 - a^(k+1)) / (1 - a)`` equals the measured tokens per forward (what ``splitserve plan
  --spec-acceptance`` takes);
- **exactness**: every speculative run's greedy tokens equal the ``off`` run's of the same
  batch, token for token; a difference is printed and the script exits 1;
- **latency**: per-token gaps of the decode phase (the engine's ``itl_seconds``, what the
  runtime's ITL histogram observes: tokens accepted in one forward arrive together, so their
  gaps are ~0): mean (= time per output token), p50, p90, and decode tokens/s, with the ratio
  to ``off``; plus process CPU seconds, less sensitive than wall time to other tenants.

Writes ``--json`` (default ``out/speculative.json``) and ``$OUT/speculative.json`` when
``OUT`` is set.

    python bench/speculative.py                  # SmolLM2-135M, ~7.5 minutes on one core
    python bench/speculative.py --batches 4,16 --ks 4 --json out/speculative-crossover.json
    python bench/speculative.py --smoke          # tiny random model, seconds: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.sequence import Sequence as EngineSequence

DEFAULT_LIMIT = ServeArgs().speculative_max_num_seqs
ROOT = Path(__file__).resolve().parent.parent

REPETITIVE = (
    "Rewrite this function with type hints and return only the code:\n\n"
    "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
    "        total += item.price * item.quantity\n    return total * (1 + tax_rate)",
    "Repeat the list below in reverse order, one item per line:\napple\nbanana\ncherry\ndate\n"
    "elderberry\nfig\ngrape\nhoneydew\nkiwi\nlemon",
    "Copy the following paragraph exactly, but replace the word 'river' with 'lake':\n\n"
    "The river was calm in the morning. Children played near the river while their parents "
    "talked. In the evening the river turned gold under the setting sun.",
    "Convert this JSON to YAML:\n"
    '{"name": "web", "replicas": 3, "image": "nginx:1.25", "ports": [80, 443], '
    '"env": {"MODE": "production", "LOG_LEVEL": "info"}}',
    "Rename the variable x to count in this code and return the whole code:\n\n"
    "x = 0\nfor line in open('data.txt'):\n    if line.strip():\n        x += 1\nprint(x)",
    "Sort these names alphabetically, one per line: Zoe, Adam, Maria, Chen, Olivia, Ben, Fatima, Liam, Grace, Noah",
    "Correct the spelling mistakes and return the full sentence: Teh quick brown fox jumpd over "
    "the lazy dog becuase it was in a hury to get home befor dark.",
    "Add a docstring to this function and return the whole function:\n\n"
    "def area(width, height):\n    if width < 0 or height < 0:\n"
    "        raise ValueError('negative size')\n    return width * height",
    "Turn this list into a numbered list:\n- buy milk\n- walk the dog\n- call the bank\n"
    "- water the plants\n- write the report\n- book the tickets",
    "Rewrite this SQL query with the keywords in upper case:\n"
    "select id, name, email from users where active = 1 and created_at > '2024-01-01' "
    "order by name limit 50",
    "Format this CSV as a Markdown table:\ncity,country,population\nTokyo,Japan,37400000\n"
    "Delhi,India,28500000\nShanghai,China,25600000\nCairo,Egypt,20000000",
    "Repeat this sentence three times: The meeting has been moved to Thursday at ten o'clock.",
    "Here is an email. Return it unchanged except that the date becomes Friday:\n\n"
    "Hi Sam,\nThe review is on Monday at 3 pm in room 204. Please bring the slides and the "
    "budget sheet.\nThanks,\nAlex",
    "Extract every line that mentions an error from this log, unchanged:\n"
    "10:01 INFO server started\n10:02 ERROR disk full on /var\n10:03 INFO request served\n"
    "10:04 ERROR timeout talking to db\n10:05 INFO request served\n10:06 ERROR disk full on /var",
    "Rewrite this paragraph in the past tense:\n\nAnna walks to the station every morning. "
    "She buys a coffee, reads the news and waits for the train. When the train arrives, she "
    "finds a seat by the window.",
    "Add a comment above each line of this code and return it:\n\n"
    "names = ['a', 'b', 'c']\nupper = [n.upper() for n in names]\nprint(', '.join(upper))",
)
OPEN_ENDED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue.",
    "What are the benefits of regular exercise?",
    "Describe a perfect day at the beach.",
    "How does a refrigerator keep food cold?",
    "Write a poem about autumn leaves.",
    "Why do cats purr?",
    "Give some tips for learning to play the guitar.",
    "Tell me a story about a dragon who is afraid of the dark.",
    "What is the difference between weather and climate?",
    "Describe the city of the future.",
    "How do bees make honey?",
    "Write a letter from a child to their grandmother.",
    "Explain how the internet works to a ten-year-old.",
    "What makes a good friend?",
    "Invent a new holiday and describe how people celebrate it.",
)
PROMPT_SETS = {"repetitive": REPETITIVE, "open-ended": OPEN_ENDED}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine configuration: the runtime's speculative flags."""

    label: str
    method: str
    num_tokens: int
    max_num_seqs: int

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclasses.dataclass
class Run:
    """One (prompt set, batch, setting): every group of ``batch`` requests, back to back."""

    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    """Generated tokens per request, in prompt order."""
    forwards: list[int] = dataclasses.field(default_factory=list)
    """Decode forwards (steps that gave the request tokens after its first) per request."""
    gaps: list[float] = dataclasses.field(default_factory=list)
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cpu_seconds: float = 0.0
    verifications: int = 0
    """Sequence-forwards that carried proposals."""
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        gaps = sorted(self.gaps)
        forwards = sum(self.forwards)
        decode_tokens = sum(max(len(t) - 1, 0) for t in self.tokens)
        return {
            "requests": len(self.tokens),
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "cpu_seconds": self.cpu_seconds,
            "tokens_per_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else 0.0,
            "itl_p50_ms": 1e3 * _percentile(gaps, 50),
            "itl_p90_ms": 1e3 * _percentile(gaps, 90),
            "itl_p99_ms": 1e3 * _percentile(gaps, 99),
            "tokens_per_forward": decode_tokens / forwards if forwards else 0.0,
            "forwards": forwards,
            "verifications": self.verifications,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "proposed_by_position": self.proposed_by_position,
            "accepted_by_position": self.accepted_by_position,
        }


def _percentile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def fit_acceptance(tokens_per_forward: float, num_tokens: int) -> float:
    """The ``a`` in [0, 1] with ``(1 - a^(k+1)) / (1 - a) = tokens_per_forward`` (bisection)."""

    def expected(a: float) -> float:
        return float(num_tokens + 1) if a >= 1.0 else (1 - a ** (num_tokens + 1)) / (1 - a)

    if tokens_per_forward <= 1.0:
        return 0.0
    if tokens_per_forward >= num_tokens + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected(mid) < tokens_per_forward else (low, mid)
    return (low + high) / 2


class VerifyCounter:
    """Counts every verification the engine makes (its ``speculation.verify``, wrapped): the stats expose
    accepted tokens by position but not how many verifications proposed that many."""

    def __init__(self, engine: LLMEngine) -> None:
        k = engine.speculative.num_tokens
        self.verifications = 0
        self.proposed_by_position = [0] * k
        self.accepted_by_position = [0] * k
        original = engine.speculation.verify

        def verify(sample_seqs: list[EngineSequence], token_ids: list[int], logprobs: list[Any]) -> list[Any]:
            proposals: list[tuple[EngineSequence, int]] = []
            row = 0
            while row < len(sample_seqs):  # rows: 1 + len(proposals) per sequence
                seq = sample_seqs[row]
                proposals.append((seq, len(seq.spec_token_ids)))
                row += 1 + len(seq.spec_token_ids)
            emitted = original(sample_seqs, token_ids, logprobs)
            for seq, num in proposals:
                if num:
                    self.verifications += 1
                    for i in range(num):
                        self.proposed_by_position[i] += 1
                    for i in range(seq.num_spec_accepted):
                        self.accepted_by_position[i] += 1
            return emitted

        engine.speculation.verify = verify  # type: ignore[method-assign]


@contextmanager
def _counting(engine: LLMEngine, counter: VerifyCounter | None, run: Run) -> Iterator[None]:
    before = engine.stats()
    if counter is not None:
        v0, p0, a0 = (counter.verifications, list(counter.proposed_by_position), list(counter.accepted_by_position))
    yield
    after = engine.stats()
    run.proposed += after.spec_decode_proposed_tokens_total - before.spec_decode_proposed_tokens_total
    run.accepted += after.spec_decode_accepted_tokens_total - before.spec_decode_accepted_tokens_total
    if counter is not None:
        run.verifications += counter.verifications - v0
        p = [x - y for x, y in zip(counter.proposed_by_position, p0, strict=True)]
        a = [x - y for x, y in zip(counter.accepted_by_position, a0, strict=True)]
        run.proposed_by_position = [x + y for x, y in zip(run.proposed_by_position or [0] * len(p), p, strict=True)]
        run.accepted_by_position = [x + y for x, y in zip(run.accepted_by_position or [0] * len(a), a, strict=True)]


def run_group(
    engine: LLMEngine, prompts: list[list[int]], *, new_tokens: int, tag: str, run: Run, counter: VerifyCounter | None
) -> None:
    """``prompts`` as concurrent requests; the decode phase (after every first token) is timed."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id=rid, prompt_token_ids=prompt, params=params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    forwards = dict.fromkeys(ids, 0)
    with _counting(engine, counter, run):
        while engine.has_unfinished() and any(not t for t in tokens.values()):  # prefill
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        t0, c0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            stepped: set[str] = set()  # an output per token: a forward is a step with any
            for out in engine.step():
                if out.new_token_ids:
                    had = len(tokens[out.request_id])
                    tokens[out.request_id].extend(out.new_token_ids)
                    stepped.add(out.request_id)
                    run.decode_tokens += len(out.new_token_ids) - (0 if had else 1)
                    run.gaps.extend(out.itl_seconds)
            for rid in stepped:
                forwards[rid] += 1
        run.decode_seconds += time.perf_counter() - t0
        run.cpu_seconds += time.process_time() - c0
    run.tokens.extend(tokens[rid] for rid in ids)
    run.forwards.extend(forwards[rid] for rid in ids)


def groups_for(prompts: list[list[int]], *, batch: int, batch1_prompts: int) -> list[list[list[int]]]:
    """The request groups of one batch size (see the module docstring)."""
    if batch == 1:
        return [[p] for p in prompts[:batch1_prompts]]
    if batch > len(prompts):
        return [[prompts[i % len(prompts)] for i in range(batch)]]
    return [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn in the model's chat template (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return [int(t) for t in tokenizer.encode(rendered, add_special_tokens=False)]
    return [int(t) for t in tokenizer.encode(text)]


def settings_for(*, ks: list[int], batches: list[int]) -> list[Setting]:
    settings = [Setting("off", "none", ks[0], DEFAULT_LIMIT)]
    settings += [Setting(f"ngram k={k}", "ngram", k, DEFAULT_LIMIT) for k in ks]
    for batch in sorted({b for b in batches if b > DEFAULT_LIMIT}):  # the first k only: time
        settings.append(Setting(f"ngram k={ks[0]} lim={batch}", "ngram", ks[0], batch))
    return settings


def applies(setting: Setting, batch: int) -> bool:
    """Whether ``setting`` is measured at ``batch`` (raised limits only at their own batch)."""
    return setting.max_num_seqs == DEFAULT_LIMIT or setting.max_num_seqs == batch


def build_engine(
    model: Path, setting: Setting, *, max_batch: int, max_tokens_per_seq: int, block_size: int = 16
) -> LLMEngine:
    blocks = max_batch * (max_tokens_per_seq // block_size + 2) + 16
    args = ServeArgs(
        model=str(model),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        block_size=block_size,
        num_kv_blocks=blocks,
        max_model_len=max_tokens_per_seq + 64,
        max_num_seqs=max(max_batch, 1),
        speculative_method=setting.method,
        num_speculative_tokens=setting.num_tokens,
        speculative_max_num_seqs=setting.max_num_seqs,
    )
    return LLMEngine.from_args(args)


@dataclasses.dataclass
class Bench:
    model: Path
    batches: list[int]
    ks: list[int]
    new_tokens: int
    batch1_prompts: int
    prompts_per_set: int
    log: Callable[[str], None] = print

    def run(self) -> dict[str, Any]:
        settings = settings_for(ks=self.ks, batches=self.batches)
        probe = build_engine(self.model, settings[0], max_batch=1, max_tokens_per_seq=64)
        prompt_sets = {
            name: [chat_prompt(probe.tokenizer, t) for t in texts[: self.prompts_per_set]]
            for name, texts in PROMPT_SETS.items()
        }
        del probe
        longest = max(len(p) for ps in prompt_sets.values() for p in ps)
        per_seq = longest + self.new_tokens + max(self.ks) + 16
        engines: dict[Setting, tuple[LLMEngine, VerifyCounter | None]] = {}
        for s in settings:
            engine = build_engine(self.model, s, max_batch=max(self.batches), max_tokens_per_seq=per_seq)
            engines[s] = (engine, VerifyCounter(engine) if s.enabled else None)
            warm = Run()  # first calls allocate; keep them out of the measurement
            run_group(engine, prompt_sets["open-ended"][:2], new_tokens=8, tag="warmup", run=warm, counter=None)
        runs: list[dict[str, Any]] = []
        mismatches: list[str] = []
        for set_name, prompts in prompt_sets.items():
            for batch in self.batches:
                groups = groups_for(prompts, batch=batch, batch1_prompts=self.batch1_prompts)
                reference: Run | None = None
                for s in settings:
                    if not applies(s, batch):
                        continue
                    engine, counter = engines[s]
                    run = Run()
                    for g, group in enumerate(groups):
                        run_group(
                            engine,
                            group,
                            new_tokens=self.new_tokens,
                            tag=f"{set_name}-b{batch}-g{g}",
                            run=run,
                            counter=counter,
                        )
                    row = {
                        "set": set_name,
                        "batch": batch,
                        "setting": s.label,
                        "method": s.method,
                        "num_tokens": s.num_tokens if s.enabled else 0,
                        "max_num_seqs": s.max_num_seqs,
                        **run.summary(),
                    }
                    if reference is None:
                        reference = run
                    else:
                        same = [a == b for a, b in zip(run.tokens, reference.tokens, strict=True)]
                        row["identical"] = sum(same)
                        for i, ok in enumerate(same):
                            if not ok:
                                mismatches.append(
                                    _describe_mismatch(set_name, batch, s.label, i, run.tokens[i], reference.tokens[i])
                                )
                    runs.append(row)
                    self.log(_row_line(row))
        return {
            "runs": runs,
            "mismatches": mismatches,
            "acceptance": acceptance_rows(
                runs, ks=self.ks, batches=self.batches, set_sizes={k: len(v) for k, v in prompt_sets.items()}
            ),
            "prompt_tokens": {k: [len(p) for p in v] for k, v in prompt_sets.items()},
        }


def _describe_mismatch(set_name: str, batch: int, label: str, index: int, got: list[int], want: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return (
        f"{set_name} batch {batch} {label}: request {index} differs from off at output token {first} "
        f"({got[first : first + 4]} vs {want[first : first + 4]}; lengths {len(got)} vs {len(want)})"
    )


def _row_line(row: dict[str, Any]) -> str:
    return (
        f"  {row['set']:<11} b={row['batch']:<3} {row['setting']:<17} "
        f"{row['tokens_per_s']:7.1f} tok/s  ITL mean {row['itl_mean_ms']:6.1f} ms  "
        f"accept {row['acceptance_rate']:.2f}  tok/fwd {row['tokens_per_forward']:.2f}"
    )


def acceptance_rows(
    runs: list[dict[str, Any]], *, ks: list[int], batches: list[int], set_sizes: dict[str, int]
) -> list[dict[str, Any]]:
    """Per set and k: the run at the largest batch <= the default limit covering every prompt."""
    rows: list[dict[str, Any]] = []
    for set_name, size in set_sizes.items():
        eligible = [b for b in batches if b <= min(DEFAULT_LIMIT, size) and b > 1] or [min(batches)]
        batch = max(eligible)
        for k in ks:
            run = next(
                r for r in runs if r["set"] == set_name and r["batch"] == batch and r["setting"] == f"ngram k={k}"
            )
            verifications = run["verifications"]
            by_position = [
                a / p if p else 0.0
                for a, p in zip(run["accepted_by_position"], run["proposed_by_position"], strict=True)
            ]
            rows.append(
                {
                    "set": set_name,
                    "k": k,
                    "batch": batch,
                    "acceptance_rate": run["acceptance_rate"],
                    "accepted_by_position": by_position,
                    "tokens_per_forward": run["tokens_per_forward"],
                    "forwards_with_proposals": verifications / run["forwards"] if run["forwards"] else 0.0,
                    "a_fit": fit_acceptance(run["tokens_per_forward"], k),
                }
            )
    return rows


def ratio_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every speculative run next to the ``off`` run of its set and batch."""
    out: list[dict[str, Any]] = []
    for row in runs:
        if row["method"] == "none":
            continue
        off = next(r for r in runs if r["set"] == row["set"] and r["batch"] == row["batch"] and r["method"] == "none")
        out.append(
            {
                **row,
                "off_tokens_per_s": off["tokens_per_s"],
                "off_itl_mean_ms": off["itl_mean_ms"],
                "off_itl_p50_ms": off["itl_p50_ms"],
                "off_itl_p90_ms": off["itl_p90_ms"],
                "speedup": row["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else 0.0,
                "cpu_speedup": off["cpu_seconds"] / row["cpu_seconds"] if row["cpu_seconds"] else 0.0,
            }
        )
    return out


def crossover(ratios: list[dict[str, Any]]) -> dict[str, Any]:
    """Per set and k, the largest measured batch at which speculating in every step (the
    limit at or above the batch) still beat ``off`` in decode tokens/s, and the smallest at
    which it lost."""
    found: dict[str, Any] = {}
    for row in ratios:
        if row["max_num_seqs"] < row["batch"]:
            continue  # this setting did not speculate in every step
        key = f"{row['set']} k={row['num_tokens']}"
        entry = found.setdefault(key, {"wins_up_to": 0, "loses_from": None})
        if row["speedup"] > 1.0:
            entry["wins_up_to"] = max(entry["wins_up_to"], row["batch"])
        elif entry["loses_from"] is None or row["batch"] < entry["loses_from"]:
            entry["loses_from"] = row["batch"]
    return found


def print_tables(report: dict[str, Any]) -> None:
    print("\nacceptance (greedy; tokens/forward = decode tokens per target forward per sequence)")
    head = (
        f"{'set':<11} {'k':>2} {'batch':>5} {'accepted/proposed':>18} {'by position':<28} "
        f"{'tok/forward':>11} {'fwd w/ proposals':>16} {'a_fit':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in report["acceptance"]:
        positions = " ".join(f"{p:.2f}" for p in r["accepted_by_position"])
        print(
            f"{r['set']:<11} {r['k']:>2} {r['batch']:>5} {r['acceptance_rate']:>18.2f} {positions:<28} "
            f"{r['tokens_per_forward']:>11.2f} {r['forwards_with_proposals']:>16.0%} {r['a_fit']:>6.2f}"
        )
    print("\nlatency (decode phase; ITL = per-token gap, ms; ratio = spec tok/s / off tok/s)")
    head = (
        f"{'set':<11} {'batch':>5} {'setting':<17} {'off mean/p50/p90':>18} {'spec mean/p50/p90':>18} "
        f"{'off tok/s':>9} {'spec tok/s':>10} {'ratio':>6} {'CPU ratio':>9} {'same':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in report["ratios"]:
        off = f"{r['off_itl_mean_ms']:.0f}/{r['off_itl_p50_ms']:.0f}/{r['off_itl_p90_ms']:.0f}"
        spec = f"{r['itl_mean_ms']:.0f}/{r['itl_p50_ms']:.0f}/{r['itl_p90_ms']:.0f}"
        same = f"{r.get('identical', 0)}/{r['requests']}"
        print(
            f"{r['set']:<11} {r['batch']:>5} {r['setting']:<17} {off:>18} {spec:>18} "
            f"{r['off_tokens_per_s']:>9.1f} {r['tokens_per_s']:>10.1f} {r['speedup']:>6.2f} "
            f"{r['cpu_speedup']:>9.2f} {same:>6}"
        )
    print("\ncrossover (speculating in every step vs off, decode tokens/s):")
    for key, entry in report["crossover"].items():
        wins = f"wins up to batch {entry['wins_up_to']}" if entry["wins_up_to"] else "never wins"
        loses = f"loses from batch {entry['loses_from']}" if entry["loses_from"] is not None else "never loses"
        print(f"  {key:<18} {wins}, {loses}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, small sizes: checks the script")
    parser.add_argument("--batches", default=None, help="concurrent sequences (default 1,8,32; smoke 1,4,20)")
    parser.add_argument("--ks", default="4,2", help="--num-speculative-tokens values")
    parser.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 96; smoke 12)")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts run alone at batch 1")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: one core, steady while others load the machine)",
    )
    parser.add_argument("--json", type=Path, default=None, help="default out/speculative.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in (args.batches or ("1,4,20" if args.smoke else "1,8,32")).split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    new_tokens = args.new_tokens or (12 if args.smoke else 96)
    json_path = args.json or ROOT / "out" / ("speculative-smoke.json" if args.smoke else "speculative.json")
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from splitserve_runtime.model.tiny import write_tiny_model

            model = write_tiny_model(out_dir=Path(tmp) / "tiny", arch="llama", seed=0)
            model_name = "tiny random llama"
        else:
            from splitserve_e2e.smollm2 import hf_dir

            model = hf_dir()
            model_name = "SmolLM2-135M-Instruct fp32 (HF dir from the Q4_1 GGUF)"
        print(
            f"{model_name}, torch backend, {args.threads} threads, batches {batches}, k {ks}, "
            f"{new_tokens} new tokens, greedy"
        )
        bench = Bench(
            model=model,
            batches=batches,
            ks=ks,
            new_tokens=new_tokens,
            batch1_prompts=args.batch1_prompts,
            prompts_per_set=4 if args.smoke else 16,
        )
        report = bench.run()
    report["ratios"] = ratio_rows(report["runs"])
    report["crossover"] = crossover(report["ratios"])
    report["config"] = {
        "model": model_name,
        "threads": args.threads,
        "batches": batches,
        "ks": ks,
        "new_tokens": new_tokens,
        "batch1_prompts": args.batch1_prompts,
        "default_max_num_seqs": DEFAULT_LIMIT,
        "smoke": args.smoke,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "seconds": time.perf_counter() - started,
    }
    print_tables(report)
    print(f"\n{report['config']['seconds']:.0f} s; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    json_path.write_text(text, encoding="utf-8")
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / json_path.name).write_text(text, encoding="utf-8")
    print(f"wrote {json_path}")
    if report["mismatches"]:
        print("\ngreedy output differs from the non-speculative run (a bug):", file=sys.stderr)
        for line in report["mismatches"]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
