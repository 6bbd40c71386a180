"""Tensor parallelism in the planner: the roofline splits a model as the runtime does (heads by
KV group, unevenly or replicated; the MLP evenly; the vocabulary by rows) and refuses what the
runtime refuses with its words; each step pays the collectives the runtime runs (two ring
all-reduces per layer and the embedding's, and the logits' all-gather); ``--tp auto`` keeps
TP 1 for a model that fits one GPU at low load and splits one that does not, showing the
all-reduce share of its decode step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve_contract.model_config import ModelConfig
from splitserve_operator.api import InferenceService
from splitserve_planner.cli import main
from splitserve_planner.gpus import get_gpu
from splitserve_planner.model_presets import PRESETS, load_model
from splitserve_planner.perf_model import (
    ALL_REDUCE_LATENCY_SECONDS,
    LOGIT_BYTES,
    ModelShape,
    RooflineModel,
    TensorParallelRefused,
    decode_step_seconds,
    roofline_model,
)
from splitserve_planner.search import PlanInputs, Slo, plan_tensor_parallel
from splitserve_planner.workload import Arrivals, LengthDist, WorkloadSpec
from splitserve_runtime.model.tensor_parallel import (
    TensorParallelError,
    TensorParallelLayout,
    check_divisible,
)


def _roofline(model: str, gpu: str, tp: int, **kwargs: Any) -> RooflineModel:
    name, config = load_model(name_or_path=model)
    return roofline_model(name=name, config=config, gpu=get_gpu(gpu), tensor_parallel=tp, dtype="bfloat16", **kwargs)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------ communication


def test_a_step_pays_two_all_reduces_per_layer_the_embeddings_and_the_logits_gather() -> None:
    perf = _roofline("llama-3.1-70b", "H100-SXM", 4)
    layers, hidden, vocab = 80, 8192, 128256
    bandwidth = get_gpu("H100-SXM").interconnect_bytes_per_second
    assert perf.all_reduces_per_step == 2 * layers + 1
    tokens, seqs = 512, 64
    ring = 2 * (4 - 1) / 4
    fixed = (2 * layers + 2) * ALL_REDUCE_LATENCY_SECONDS
    payload = (2 * layers + 1) * ring * hidden * 2 * tokens / bandwidth  # bf16 activations
    logits = (4 - 1) * math.ceil(vocab / 4) * LOGIT_BYTES * seqs / bandwidth
    assert perf.communication_seconds(num_tokens=tokens, num_seqs=seqs) == pytest.approx(
        fixed + payload + logits, rel=1e-12
    )
    # ... and it is in the step: an unlimited interconnect saves exactly the payload part
    unlimited = dataclasses.replace(perf, gpu=dataclasses.replace(perf.gpu, interconnect_bytes_per_second=1e30))
    step = {"num_tokens": tokens, "num_seqs": seqs, "num_attention_pairs": 10**6, "num_kv_tokens": 10**5}
    assert perf.step_seconds(**step) - unlimited.step_seconds(**step) == pytest.approx(payload + logits, rel=1e-6)


def test_the_payload_grows_with_the_ring_factor_and_tp_1_has_none() -> None:
    def payload(tp: int) -> float:
        perf = _roofline("llama-3.1-70b", "B200", tp)
        return perf.communication_seconds(num_tokens=1000, num_seqs=0) - perf.communication_seconds(
            num_tokens=0, num_seqs=0
        )

    two = payload(2)
    assert [payload(tp) / two for tp in (4, 8)] == pytest.approx([1.5, 1.75])  # 2(tp-1)/tp over 2(2-1)/2
    single = _roofline("llama-3.1-8b", "H100-SXM", 1)
    assert single.all_reduces_per_step == 0
    assert single.communication_seconds(num_tokens=8192, num_seqs=256) == 0.0


def test_tensor_parallelism_shortens_a_decode_step_but_not_by_tp() -> None:
    steps = {
        tp: decode_step_seconds(_roofline("llama-3.1-70b", "H200", tp), batch_size=8, num_context_tokens=8192)
        for tp in (2, 4, 8)
    }
    assert steps[2] > steps[4] > steps[8]
    assert steps[8] > steps[2] / 4  # collectives and the fixed overhead do not shrink


# ------------------------------------------------------------------------------ the split


def _config(*, heads: int, kv: int, intermediate: int, vocab: int = 1000) -> ModelConfig:
    return ModelConfig.from_dict(
        dict(
            PRESETS["tiny"],
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=intermediate,
            hidden_size=heads * 16,
            head_dim=16,
            vocab_size=vocab,
        )
    )


SHAPES = [(32, 8, 14336), (64, 8, 28672), (28, 4, 18944), (9, 3, 96), (4, 2, 128), (12, 4, 60), (8, 1, 64), (6, 6, 36)]


@pytest.mark.parametrize(("heads", "kv", "intermediate"), SHAPES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shards_and_refusals_are_the_runtimes(heads: int, kv: int, intermediate: int, tp: int) -> None:
    config = _config(heads=heads, kv=kv, intermediate=intermediate)
    shape = ModelShape.from_config(config)
    problems = shape.split_problems(tp)
    try:
        check_divisible(config, tp)
    except TensorParallelError as exc:
        assert str(exc) == f"tensor-parallel size {tp} does not fit the model: {'; '.join(problems)}"
        return
    assert problems == []
    ranks = [TensorParallelLayout(config=config, rank=r, size=tp) for r in range(tp)]
    assert shape.kv_heads_per_gpu(tp) == max(layout.num_kv_heads for layout in ranks)
    assert shape.q_heads_per_gpu(tp) == max(layout.num_heads for layout in ranks)
    assert shape.vocab_rows_per_gpu(tp) == max(layout.vocab_rows for layout in ranks)
    assert all(layout.intermediate_size * tp == intermediate for layout in ranks)


def test_weights_split_by_tp_and_kv_heads_replicate() -> None:
    whole = _roofline("llama-3.1-70b", "H200", 2).shape.weight_bytes(_roofline("llama-3.1-70b", "H200", 2).precision)
    for tp in (2, 4, 8):
        perf = _roofline("llama-3.1-70b", "H200", tp)
        assert perf.weight_bytes_per_gpu == pytest.approx(whole / tp, rel=1e-4)  # 8 KV heads divide evenly
    qwen = _roofline("qwen2-7b", "H100-SXM", 4)  # 4 KV heads, 4 ranks: one each
    assert qwen.kv_bytes_per_token_per_gpu == qwen.kv_bytes_per_token // 4
    llama = _roofline("llama-3.1-8b", "H100-SXM", 8)  # 8 KV heads over 8 ranks
    assert llama.kv_bytes_per_token_per_gpu == llama.kv_bytes_per_token // 8


def test_what_the_runtime_refuses_is_refused_in_its_words() -> None:
    with pytest.raises(
        TensorParallelRefused,
        match="qwen2-7b: tensor-parallel size 8 does not fit the model: "
        "4 KV heads with 7 query heads each cannot be replicated evenly",
    ):
        _roofline("qwen2-7b", "H100-SXM", 8)
    name, config = load_model(name_or_path="llama-3.1-8b")  # a pre-quantized checkpoint splits like a dense one
    quantized = dataclasses.replace(config, quantization_config={"quant_method": "fp8"})
    roofline_model(name=name, config=quantized, gpu=get_gpu("H100-SXM"), tensor_parallel=2, dtype="bfloat16")


# ------------------------------------------------------------------------------ choosing a size


def _inputs_at(model: str, gpu: str, rate: float) -> Callable[[int], PlanInputs]:
    requests = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=rate),
        prompt_tokens=LengthDist.parse("lognormal:1024:0.6"),
        output_tokens=LengthDist.parse("lognormal:128:0.6"),
    ).generate(duration_seconds=20, seed=0)

    def inputs_at(tp: int) -> PlanInputs:
        return PlanInputs(
            perf=_roofline(model, gpu, tp),
            requests=requests,
            gpus_per_replica=tp,
            slo=Slo(ttft_p99_seconds=1.5, itl_p99_seconds=0.05),
        )

    return inputs_at


def test_a_model_that_fits_one_gpu_keeps_tp_1_at_low_load() -> None:
    search = plan_tensor_parallel(_inputs_at("llama-3.1-8b", "H100-SXM", 1), (1, 2, 4, 8), compare_prefix_caching=False)
    best = search.best
    assert best is not None and best.tensor_parallel == 1
    assert best.best is not None and best.best.num_gpus == 1
    # a bigger pod cannot use fewer GPUs than one GPU: not even simulated
    assert [o.reason.startswith("not searched: one pod of") for o in search.options] == [False, True, True, True]


def test_a_model_that_does_not_fit_one_gpu_is_split() -> None:
    search = plan_tensor_parallel(
        _inputs_at("llama-3.1-70b", "H100-SXM", 1), (1, 2, 4, 8), compare_prefix_caching=False
    )
    reasons = {o.tensor_parallel: o.reason for o in search.options}
    assert "needs 151.8 GiB per GPU at TP=1" in reasons[1]
    best = search.best
    assert best is not None and best.tensor_parallel >= 2 and best.best is not None
    assert best.best.gpus_per_replica == best.tensor_parallel
    assert all(o.best is None or o.best.num_gpus >= best.best.num_gpus for o in search.options)


def test_cli_auto_keeps_tp_1_for_a_small_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    manifest = tmp_path / "isvc.yaml"
    code, out, err = _run(
        capsys,
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "H100",
        "--rate",
        "1",
        "--duration-s",
        "20",
        "--emit-manifest",
        str(manifest),
    )
    assert code == 0, err
    assert "tensor parallelism (--tp auto" in out and "  TP=1: 1 GPUs" in out
    assert "  TP=2: not searched: one pod of 2 GPUs cannot beat 1 GPUs at TP=1" in out
    assert "model llama-3.1-8b, TP=1," in out and "all-reduce" not in out
    pools = _pools(manifest)
    assert pools and all(p.parallelism.tensor == p.resources.gpus == 1 for p in pools)


def test_cli_auto_splits_a_70b_model_on_80_gb_gpus_and_shows_the_all_reduces(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "isvc.yaml"
    code, out, err = _run(
        capsys,
        "--model",
        "llama-3.1-70b",
        "--gpu",
        "H100",
        "--rate",
        "1",
        "--duration-s",
        "20",
        "--emit-manifest",
        str(manifest),
    )
    assert code == 0, err
    assert "  TP=1: llama-3.1-70b (bfloat16) needs 151.8 GiB per GPU at TP=1" in out
    chosen = next(line for line in out.splitlines() if line.startswith("model llama-3.1-70b, TP="))
    tp = int(chosen.split("TP=")[1].split(",")[0])
    assert tp >= 2
    assert "all-reduce" in chosen  # the header's decode step names its communication share
    (line,) = [line for line in out.splitlines() if line.startswith(f"  TP={tp}: ")]
    assert f"161 ring all-reduces of 8192 x 2 B per token, 2({tp}-1)/{tp} of each over 450 GB/s" in line
    assert f"x {tp} GPU = " in out
    pools = _pools(manifest)
    assert pools and all(p.parallelism.tensor == p.resources.gpus == tp for p in pools)


def _pools(manifest: Path) -> list[Any]:
    spec = InferenceService.parse(yaml.safe_load(manifest.read_text())).spec
    return [p for p in (spec.prefill, spec.decode, spec.aggregated) if p is not None]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--model", "qwen2-7b", "--tp", "8", "--rate", "1"),
            "tensor-parallel size 8 does not fit the model: 4 KV heads with 7 query heads each cannot be replicated evenly",
        ),
        (("--model", "llama-3.1-70b", "--gpu", "H100", "--tp", "2", "--rate", "1"), "needs 78.1 GiB per GPU at TP=2"),
    ],
)
def test_cli_refuses_a_size_the_model_cannot_use(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err


def test_a_profile_plans_at_the_size_it_was_measured_at(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve_planner.profile import shipped_profiles

    (profile,) = [p for p in shipped_profiles() if p.name == "cpu-tiny-llama.json"]
    code, _, err = _run(capsys, "--model", "tiny", "--profile", str(profile), "--tp", "2", "--rate", "1")
    assert code == 2 and "was measured at TP=1, not TP=2" in err
