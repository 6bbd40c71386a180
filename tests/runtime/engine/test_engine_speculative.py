"""Speculative decoding (n-gram proposals) in the engine: greedy output is token for token the
non-speculative one in every scheduling situation (batches, chunked prefill, prefix hits,
preemption, a disaggregated decode); KV blocks and prefix-cache hashes end exactly as without
speculation; sampled output keeps the target distribution (a total-variation check that fails
when the acceptance rule is broken)."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from splitserve_contract import ServeArgs
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.speculative import NgramProposer, SpeculativeConfig

BASE = ServeArgs(
    device="cpu",
    block_size=4,
    num_kv_blocks=256,
    max_model_len=256,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    attention_backend="torch",
    dtype="float32",
)
# repetitive prompts give the n-gram proposer something to find
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13, 11, 12, 13, 11, 12],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 20, 21, 22],
    [40, 41, 40, 41, 40, 41, 40],
    [3, 3, 3, 3, 3, 3],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
]


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine.from_args(dataclasses.replace(BASE, model=str(model_dir), **overrides))


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
) -> dict[str, list[int]]:
    all_params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, all_params, strict=True)):
        engine.add_request(request_id=f"r{i}", prompt_token_ids=prompt, params=p)
    out: dict[str, list[int]] = collections.defaultdict(list)
    for _ in range(10_000):
        if not engine.has_unfinished():
            return dict(out)
        for step_out in engine.step():
            out[step_out.request_id].extend(step_out.new_token_ids)
    raise AssertionError("the engine did not finish")


def test_ngram_proposer_finds_the_latest_longest_match() -> None:
    proposer = NgramProposer(max_n=3, min_n=1)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], max_tokens=2) == [7, 1]  # latest match wins
    assert proposer.propose([4, 5, 6, 4, 5], max_tokens=5) == [6, 4, 5]  # stops at the end
    assert proposer.propose([1, 2, 3, 4], max_tokens=3) == []  # nothing repeats
    assert proposer.propose([1, 2, 1], max_tokens=0) == []
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        SpeculativeConfig(method="medusa")


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 8},
        {"num_kv_blocks": 24},
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 8},
        {"prefix_caching": False},
    ],
    ids=["batch", "chunked-prefill", "preemption", "k1", "k8", "no-prefix-cache"],
)
def test_greedy_output_equals_plain_decoding(tiny_llama_dir: Path, settings: dict[str, Any]) -> None:
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[1] + [7]]  # prefix hits too
    plain_settings = {k: v for k, v in settings.items() if k != "num_speculative_tokens"}
    plain = _engine(tiny_llama_dir, **plain_settings)
    spec = _engine(tiny_llama_dir, speculative_method="ngram", **settings)
    want = _run(plain, prompts, GREEDY)
    got = _run(spec, prompts, GREEDY)
    assert got == want
    stats = spec.stats()
    assert stats.spec_decode_proposed_tokens_total > 0 and stats.spec_decode_accepted_tokens_total > 0
    if "max_num_batched_tokens" not in settings:  # (a tiny budget shared with prefills: not fewer)
        assert stats.steps_total < plain.stats().steps_total  # accepted proposals saved steps
    if settings == {"num_kv_blocks": 24}:
        assert spec.stats().preemptions_total > 0  # the situation really arose
    # KV rollback: blocks and prefix-cache contents end exactly as without speculation
    assert spec.block_manager.num_free_blocks == plain.block_manager.num_free_blocks
    assert set(spec.block_manager._hash_to_block) == set(plain.block_manager._hash_to_block)


def test_one_at_a_time_and_opt_out_and_batch_limit(tiny_llama_dir: Path) -> None:
    plain = _engine(tiny_llama_dir)
    want = _run(plain, PROMPTS, GREEDY)
    for i, prompt in enumerate(PROMPTS):  # batch 1
        engine = _engine(tiny_llama_dir, speculative_method="ngram")
        assert _run(engine, [prompt], GREEDY)["r0"] == want[f"r{i}"]
    opted_out = _engine(tiny_llama_dir, speculative_method="ngram")
    _run(opted_out, PROMPTS, dataclasses.replace(GREEDY, speculative=False))
    assert opted_out.stats().spec_decode_proposed_tokens_total == 0
    limited = _engine(tiny_llama_dir, speculative_method="ngram", speculative_max_num_seqs=len(PROMPTS) - 1)
    assert _run(limited, PROMPTS, GREEDY) == want
    # proposals only once fewer than len(PROMPTS) sequences decode (the first ones finished)
    full = _engine(tiny_llama_dir, speculative_method="ngram")
    _run(full, PROMPTS, GREEDY)
    assert limited.stats().spec_decode_proposed_tokens_total < full.stats().spec_decode_proposed_tokens_total


def test_stop_tokens_and_max_tokens_inside_accepted_proposals(tiny_llama_dir: Path) -> None:
    """A stop token or the length limit reached in the middle of accepted proposals ends the
    request there, exactly where plain decoding ends it."""
    plain = _engine(tiny_llama_dir)
    free_run = _run(plain, PROMPTS, GREEDY)
    params = [
        dataclasses.replace(GREEDY, stop_token_ids=[free_run[f"r{i}"][5]], max_tokens=7 + i)
        for i in range(len(PROMPTS))
    ]
    want = _run(_engine(tiny_llama_dir), PROMPTS, params)
    got = _run(_engine(tiny_llama_dir, speculative_method="ngram"), PROMPTS, params)
    assert got == want
    assert all(len(tokens) <= 7 + i for i, tokens in enumerate(got.values()))


def _first_tokens(
    engine: LLMEngine,
    *,
    n: int,
    seed: int = 0,
    broken: bool = False,
) -> collections.Counter[tuple[int, ...]]:
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]  # the proposer offers 7, 5, 6, ...
    # top-k 8 keeps the pairs (first token, second token) to at most 64 outcomes; the second
    # token is the one verified against a proposal
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True, seed=seed + i) for i in range(n)]
    if broken:  # an acceptance rule that keeps every proposal
        original = engine.speculation.verify

        def always_accept(sample_seqs: Any, token_ids: list[int], logprobs: Any) -> Any:
            token_ids = list(token_ids)
            row = 0
            while row < len(sample_seqs):
                drafts = sample_seqs[row].spec_token_ids
                for i, draft in enumerate(drafts):
                    token_ids[row + i] = draft
                row += 1 + len(drafts)
            return original(sample_seqs, token_ids, logprobs)

        engine.speculation.verify = always_accept  # type: ignore[method-assign]
    out = _run(engine, [prompt] * n, params)
    return collections.Counter(tuple(tokens[:2]) for tokens in out.values())


@dataclasses.dataclass(frozen=True)
class _Constant:
    """Proposes one fixed token (a proposer is any deterministic function of the tokens)."""

    token: int

    def propose(self, token_ids: list[int], *, max_tokens: int) -> list[int]:
        return [self.token] if max_tokens > 0 else []


def _total_variation(a: collections.Counter[Any], b: collections.Counter[Any]) -> float:
    n_a, n_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / n_a - b[k] / n_b) for k in set(a) | set(b))


def test_sampling_keeps_the_target_distribution(tiny_llama_dir: Path) -> None:
    """The first two tokens of 1,500 seeded requests: speculative and plain sampling are as close
    as two plain runs with other seeds are to each other; always accepting proposals is far off;
    and with the same seeds speculative sampling gives exactly plain sampling's tokens."""
    n = 1500
    settings = {"max_num_seqs": 256, "num_kv_blocks": 1024, "max_num_batched_tokens": 4096}
    spec_settings = {"speculative_method": "ngram", "speculative_max_num_seqs": 256, **settings}
    plain = _first_tokens(_engine(tiny_llama_dir, **settings), n=n)
    plain_again = _first_tokens(_engine(tiny_llama_dir, **settings), n=n, seed=n)
    # propose the most common second token: accepted often, rejected often, so both branches count
    proposal = collections.Counter(pair[1] for pair in plain.elements()).most_common(1)[0][0]
    spec_engine = _engine(tiny_llama_dir, **spec_settings)
    spec_engine.speculation.proposer = _Constant(proposal)
    spec = _first_tokens(spec_engine, n=n, seed=2 * n)
    stats = spec_engine.stats()
    assert stats.spec_decode_proposed_tokens_total >= n  # every request verified a proposal
    assert 0.1 * n < stats.spec_decode_accepted_tokens_total < 0.9 * n
    broken_engine = _engine(tiny_llama_dir, **spec_settings)
    broken_engine.speculation.proposer = _Constant(proposal)
    broken = _first_tokens(broken_engine, n=n, seed=2 * n, broken=True)
    noise = _total_variation(plain, plain_again)
    tv_spec, tv_broken = _total_variation(plain, spec), _total_variation(plain, broken)
    print(
        f"\nTV: plain vs plain (other seeds) {noise:.3f}, vs speculative {tv_spec:.3f}, "
        f"vs always-accept {tv_broken:.3f}"
    )
    assert tv_spec < 1.5 * noise + 0.02
    assert tv_broken > 3 * noise
    # coupled: with plain sampling's seeds, speculative sampling draws plain sampling's tokens
    same_seeds = _engine(tiny_llama_dir, **spec_settings)
    same_seeds.speculation.proposer = _Constant(proposal)
    assert _first_tokens(same_seeds, n=n) == plain


def test_logprobs_of_accepted_tokens_are_the_targets(tiny_llama_dir: Path) -> None:
    """Each emitted token's logprobs come from its own verification row: the same numbers
    (up to float32 summation order) as plain decoding reports."""
    params = dataclasses.replace(GREEDY, logprobs=3)

    def run(engine: LLMEngine) -> list[Any]:
        engine.add_request(request_id="r", prompt_token_ids=PROMPTS[0], params=params)
        logprobs: list[Any] = []
        while engine.has_unfinished():
            for out in engine.step():
                logprobs.extend(out.new_logprobs or [])
        return logprobs

    spec = _engine(tiny_llama_dir, speculative_method="ngram")
    got, want = run(spec), run(_engine(tiny_llama_dir))
    assert spec.stats().spec_decode_accepted_tokens_total > 0
    assert [g.token_id for g in got] == [w.token_id for w in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g.logprob - w.logprob) < 1e-4
        assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]


# ------------------------------------------------------------------ draft model
@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer model with the tiny model's tokenizer and vocabulary (its own random weights)."""
    from splitserve_runtime.model.tiny import write_tiny_model

    out: Path = write_tiny_model(out_dir=tmp_path_factory.mktemp("tiny-draft"), arch="llama", seed=7, num_layers=1)
    return out


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 24}, {"num_speculative_tokens": 2}],
    ids=["batch", "chunked-prefill", "preemption", "k2"],
)
def test_draft_model_greedy_output_equals_plain_decoding(
    tiny_llama_dir: Path, tiny_draft_dir: Path, settings: dict[str, Any]
) -> None:
    """A draft model that is the target itself proposes exactly what the target picks (every
    proposal accepted); a different one-layer draft is mostly rejected. Both give the plain
    output, and the KV pool ends as without speculation."""
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[1] + [7]]
    plain_settings = {k: v for k, v in settings.items() if k != "num_speculative_tokens"}
    plain = _engine(tiny_llama_dir, **plain_settings)
    want = _run(plain, prompts, GREEDY)
    for draft, all_accepted in ((tiny_llama_dir, True), (tiny_draft_dir, False)):
        spec = _engine(tiny_llama_dir, speculative_method="draft", speculative_draft_model=str(draft), **settings)
        assert _run(spec, prompts, GREEDY) == want
        stats = spec.stats()
        assert stats.spec_decode_proposed_tokens_total > 0
        if all_accepted:
            assert stats.spec_decode_accepted_tokens_total == stats.spec_decode_proposed_tokens_total
            if "max_num_batched_tokens" not in settings:
                assert stats.steps_total < plain.stats().steps_total / 2
        else:
            assert stats.spec_decode_accepted_tokens_total < stats.spec_decode_proposed_tokens_total
        assert spec.block_manager.num_free_blocks == plain.block_manager.num_free_blocks
        assert set(spec.block_manager._hash_to_block) == set(plain.block_manager._hash_to_block)


def test_a_draft_model_must_share_the_vocabulary(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from splitserve_runtime.model import ModelLoadError
    from splitserve_runtime.model.tiny import write_tiny_model

    other = write_tiny_model(out_dir=tmp_path / "other", vocab_size=300, num_layers=1)
    with pytest.raises(ModelLoadError, match="has a vocabulary of 300 tokens, the model 512: they must share one"):
        _engine(tiny_llama_dir, speculative_method="draft", speculative_draft_model=str(other))
    with pytest.raises(ValueError, match="--speculative-method draft needs --speculative-draft-model"):
        _engine(tiny_llama_dir, speculative_method="draft")


def test_stop_strings_end_the_text_where_plain_decoding_does(tiny_llama_dir: Path) -> None:
    """A stop string completed inside accepted proposals cuts the text at the same place."""

    def texts(engine: LLMEngine, params: SamplingParams) -> dict[str, str]:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(request_id=f"r{i}", prompt_token_ids=prompt, params=params)
        out: dict[str, str] = collections.defaultdict(str)
        while engine.has_unfinished():
            for step_out in engine.step():
                out[step_out.request_id] += step_out.new_text
        return dict(out)

    free = texts(_engine(tiny_llama_dir), GREEDY)
    stops = sorted({text[len(text) // 2 : len(text) // 2 + 2] for text in free.values() if len(text) > 4})
    params = dataclasses.replace(GREEDY, stop=stops[:4])
    want = texts(_engine(tiny_llama_dir), params)
    spec = _engine(tiny_llama_dir, speculative_method="ngram")
    assert texts(spec, params) == want
    assert spec.stats().spec_decode_accepted_tokens_total > 0
    assert any(len(want[k]) < len(free[k]) for k in want)  # some stop string did cut


# ------------------------------------------------------------------ seeds under load
SEEDED = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1234)
PEAKED = dataclasses.replace(SEEDED, top_k=2, seed=99)  # (proposals often accepted)


def _alone_and_loaded(engine_for: Any, params: SamplingParams) -> tuple[list[int], list[int], LLMEngine, LLMEngine]:
    """The seeded request's tokens run alone, then with six other requests that end after 2 to
    7 tokens (so with ``speculative_max_num_seqs`` 2, speculation is off for the request's first
    steps and on for its last); and the engines of the two runs."""
    alone_engine = engine_for()
    alone = _run(alone_engine, [PROMPTS[0]], params)["r0"]
    others = [
        SamplingParams(temperature=1.0, max_tokens=2 + i, ignore_eos=True, seed=None if i % 2 else i) for i in range(6)
    ]
    loaded_engine = engine_for()
    loaded = _run(loaded_engine, [PROMPTS[0], *PROMPTS], [params, *others])["r0"]
    return alone, loaded, alone_engine, loaded_engine


@pytest.mark.parametrize("method", ["none", "ngram", "draft-self", "draft-other"])
@pytest.mark.parametrize("params", [SEEDED, PEAKED], ids=["temperature-1", "top-k-2"])
def test_a_seeded_request_gives_the_same_tokens_alone_under_load_and_without_speculation(
    tiny_llama_dir: Path, tiny_draft_dir: Path, method: str, params: SamplingParams
) -> None:
    """Pins the defect where a seed's draws advanced once per verified row and speculation
    switched off above ``speculative_max_num_seqs``: the same seeded request gave other tokens
    alone than beside other requests. Each output position now has its own draw, so the
    request gives the tokens of plain (non-speculative) sampling whatever shares its steps,
    with n-gram proposals and with a draft model (the target itself: its greedy proposals are
    often accepted under top-k 2; or another model: rejected)."""
    settings: dict[str, Any] = {"speculative_max_num_seqs": 2}
    if method == "ngram":
        settings["speculative_method"] = "ngram"
    elif method.startswith("draft"):
        draft = tiny_llama_dir if method == "draft-self" else tiny_draft_dir
        settings.update(speculative_method="draft", speculative_draft_model=str(draft))
    plain = _run(_engine(tiny_llama_dir), [PROMPTS[0]], params)["r0"]
    alone, loaded, alone_engine, loaded_engine = _alone_and_loaded(lambda: _engine(tiny_llama_dir, **settings), params)
    assert len(plain) == params.max_tokens
    assert loaded == alone  # whatever shares the steps
    assert alone == plain  # with speculation or without
    if method == "none":
        return
    # the situations arose: proposals verified (at temperature 1 the n-gram proposer finds a
    # match only in the prompt, at the first step, which the loaded run does not speculate)...
    assert alone_engine.stats().spec_decode_proposed_tokens_total > 0
    if not (method == "ngram" and params is SEEDED):
        assert loaded_engine.stats().spec_decode_proposed_tokens_total > 0
    if method != "draft-other" and params is PEAKED:  # ... and accepted
        assert alone_engine.stats().spec_decode_accepted_tokens_total > 0
        assert loaded_engine.stats().spec_decode_accepted_tokens_total > 0
