"""Pricing quantization: bytes per weight by method, KV bytes by KV dtype, the tensor-core
rate each method's GEMMs run at, FP8 refused where the GPU has none, and the manifests of
plans priced at each precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve_operator.api import InferenceService
from splitserve_planner.cli import main
from splitserve_planner.gpus import get_gpu
from splitserve_planner.manifest import build_manifest
from splitserve_planner.model_presets import load_model
from splitserve_planner.perf_model import (
    ModelDoesNotFit,
    ModelShape,
    RooflineModel,
    decode_step_seconds,
    roofline_model,
)
from splitserve_planner.precision import QUANTIZATIONS, Precision
from splitserve_planner.search import PlanInputs, Slo, plan_all
from splitserve_planner.workload import Arrivals, LengthDist, WorkloadSpec

# Llama-3.1-8B's published config.json, counted by hand: q, k, v, o and gate, up, down per layer.
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV_WIDTH = 4096, 14336, 32, 128256, 8 * 128
LINEAR = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_WIDTH + 3 * HIDDEN * INTERMEDIATE)  # 6,979,321,856
DENSE = 2 * VOCAB * HIDDEN  # embeddings + untied LM head, always in the activation dtype


def _llama8b(
    *, gpu: str = "H100-SXM", dtype: str = "bfloat16", quantization: str = "none", kv_cache_dtype: str = "auto"
) -> RooflineModel:
    name, config = load_model(name_or_path="llama-3.1-8b")
    return roofline_model(
        name=name,
        config=config,
        gpu=get_gpu(gpu),
        tensor_parallel=1,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.mark.parametrize(
    ("dtype", "quantization", "expected_bytes", "about_gb"),
    [
        ("bfloat16", "none", LINEAR * 2 + DENSE * 2, 16.06),
        ("bfloat16", "fp8", LINEAR * 1 + DENSE * 2, 9.08),
        ("bfloat16", "int8", LINEAR * 1 + DENSE * 2, 9.08),
        ("bfloat16", "int4", LINEAR * 17 // 32 + DENSE * 2, 5.81),  # 0.5 + 2 * 2 / 128 = 17/32 byte
        ("float32", "none", LINEAR * 4 + DENSE * 4, 32.12),
        ("float32", "int4", LINEAR * 9 // 16 + DENSE * 4, 8.13),  # fp32 group scales + offsets: 0.5 + 8/128
    ],
)
def test_weight_bytes_per_method_on_llama_3_8b(
    dtype: str, quantization: str, expected_bytes: int, about_gb: float
) -> None:
    _, config = load_model(name_or_path="llama-3.1-8b")
    shape = ModelShape.from_config(config)
    assert shape.linear_params == LINEAR and shape.dense_params == DENSE
    precision = Precision(dtype=dtype, quantization=quantization)
    assert shape.weight_bytes(precision) == expected_bytes
    assert expected_bytes / 1e9 == pytest.approx(about_gb, abs=0.01)
    perf = _llama8b(dtype=dtype, quantization=quantization)
    assert perf.weight_bytes_per_gpu == expected_bytes
    # a decode step streams every matmul weight: the linear layers quantized, the LM head dense
    lm_head = VOCAB * HIDDEN * precision.activation_bytes
    assert perf.weight_bytes_read_per_step == round(LINEAR * precision.linear_weight_bytes) + lm_head


def test_smaller_weights_leave_more_kv_and_decode_faster() -> None:
    models = {q: _llama8b(quantization=q) for q in ("none", "int8", "int4")}
    capacity = [models[q].kv_capacity_tokens for q in ("none", "int8", "int4")]
    step = [decode_step_seconds(models[q], batch_size=1, num_context_tokens=1024) for q in ("none", "int8", "int4")]
    assert capacity == sorted(capacity) and capacity[0] < capacity[2]
    assert step == sorted(step, reverse=True) and step[2] < 0.5 * step[0]
    bf16 = models["none"]
    freed = bf16.weight_bytes_per_gpu - models["int4"].weight_bytes_per_gpu
    assert (
        models["int4"].kv_capacity_tokens == (bf16.kv_budget_bytes_per_gpu + freed) // bf16.kv_bytes_per_token_per_gpu
    )


def test_fp8_kv_cache_halves_kv_bytes_and_doubles_capacity() -> None:
    auto, fp8 = _llama8b(), _llama8b(kv_cache_dtype="fp8")
    assert auto.kv_bytes_per_token == 2 * LAYERS * KV_WIDTH * 2 == 131072
    assert fp8.kv_bytes_per_token == auto.kv_bytes_per_token // 2
    assert fp8.kv_bytes_per_token_per_gpu == auto.kv_bytes_per_token_per_gpu // 2
    assert fp8.kv_budget_bytes_per_gpu == auto.kv_budget_bytes_per_gpu  # weights unchanged
    assert fp8.kv_capacity_tokens == auto.kv_budget_bytes_per_gpu // 65536 >= 2 * auto.kv_capacity_tokens
    fp32 = _llama8b(dtype="float32", kv_cache_dtype="auto")
    assert fp32.kv_bytes_per_token == 2 * auto.kv_bytes_per_token  # auto follows the activation dtype


@pytest.mark.parametrize(
    ("gpu", "quantization", "gemm_rate"),
    [
        ("A100-80GB", "none", 312e12),
        ("A100-80GB", "int8", 624e12),  # W8A8 int8: INT8 tensor cores
        ("A100-80GB", "int4", 312e12),  # W4A16: activations stay 16-bit, bf16 rate
        ("H100-SXM", "fp8", 1979e12),  # W8A8 fp8: FP8 tensor cores
        ("H100-SXM", "int8", 1979e12),
        ("L40S", "int8", 733e12),
        ("H200", "int4", 989e12),
    ],
)
def test_prefill_gemms_run_at_the_methods_tensor_core_rate(gpu: str, quantization: str, gemm_rate: float) -> None:
    perf = _llama8b(gpu=gpu, quantization=quantization)
    spec = get_gpu(gpu)
    tokens = 8192  # compute-bound: 2·7e9·8192 FLOPs dwarf the weight read
    # one chunk of new tokens, no attention pairs: linear GEMMs + the KV written + the fixed step cost
    seconds = perf.step_seconds(num_tokens=tokens, num_seqs=0, num_attention_pairs=0, num_kv_tokens=0)
    linear = 2 * LINEAR * tokens / (gemm_rate * spec.compute_efficiency)
    kv_write = perf.kv_bytes_per_token_per_gpu * tokens / (spec.hbm_bytes_per_second * spec.bandwidth_efficiency)
    assert seconds == pytest.approx(linear + kv_write + spec.step_overhead_seconds, rel=1e-12)


def test_lm_head_and_attention_stay_at_the_activation_rate() -> None:
    int8, bf16 = _llama8b(gpu="A100-80GB", quantization="int8"), _llama8b(gpu="A100-80GB")
    a100 = get_gpu("A100-80GB")
    bf16_rate = 312e12 * a100.compute_efficiency
    byte_rate = a100.hbm_bytes_per_second * a100.bandwidth_efficiency
    pairs = 10**9  # attention-bound, no new tokens: the weights are still read once
    seconds = int8.step_seconds(num_tokens=0, num_seqs=0, num_attention_pairs=pairs, num_kv_tokens=0)
    attention = 4 * LAYERS * HIDDEN * pairs / bf16_rate
    weights = int8.weight_bytes_read_per_step / byte_rate
    assert seconds == pytest.approx(weights + attention + a100.step_overhead_seconds, rel=1e-12)
    seqs = 10**6  # LM-head-bound: 2·vocab·hidden FLOPs per sampled sequence, at the bf16 rate
    lm_head = {"num_tokens": 0, "num_seqs": seqs, "num_attention_pairs": 0, "num_kv_tokens": 0}
    expected = 2 * VOCAB * HIDDEN * seqs / bf16_rate + a100.step_overhead_seconds
    assert int8.step_seconds(**lm_head) == pytest.approx(expected, rel=1e-12)
    assert bf16.step_seconds(**lm_head) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("gpu", "kwargs", "message"),
    [
        (
            "A100-80GB",
            {"quantization": "fp8"},
            "A100-80GB has no FP8 tensor cores: --quantization fp8 needs one of "
            "H100-SXM, H100-PCIe, H200, L40S, B200; use --quantization int8 or int4",
        ),
        ("A100-80GB", {"dtype": "fp8"}, "A100-80GB has no FP8 tensor cores"),  # the legacy alias
        ("A10G", {"kv_cache_dtype": "fp8"}, "A10G has no FP8 support: --kv-cache-dtype fp8 needs one of"),
    ],
)
def test_fp8_is_refused_on_gpus_without_it(gpu: str, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _llama8b(gpu=gpu, **kwargs)
    int8 = _llama8b(gpu=gpu, quantization="int8")  # the suggested way out works
    assert int8.precision.gemm_operand == "int8"


@pytest.mark.parametrize(
    ("gpu", "quantization", "remedy"),
    [
        (
            "H100-SXM",
            "none",
            "use a larger --tp, --quantization fp8|int8|int4, --kv-cache-dtype fp8 or a bigger or faster GPU",
        ),
        ("H100-SXM", "fp8", "use a larger --tp, --quantization int4, --kv-cache-dtype fp8 or a bigger or faster GPU"),
        ("A100-80GB", "none", "use a larger --tp, --quantization int8|int4 or a bigger or faster GPU"),  # no fp8 there
    ],
)
def test_a_model_that_does_not_fit_names_the_smaller_settings(gpu: str, quantization: str, remedy: str) -> None:
    name, config = load_model(name_or_path="llama-3.1-70b")
    with pytest.raises(ModelDoesNotFit) as info:
        roofline_model(
            name=name, config=config, gpu=get_gpu(gpu), tensor_parallel=1, dtype="bfloat16", quantization=quantization
        )
    assert str(info.value).endswith(remedy)
    int4 = roofline_model(
        name=name, config=config, gpu=get_gpu(gpu), tensor_parallel=1, dtype="bfloat16", quantization="int4"
    )
    assert int4.kv_capacity_tokens > 32768  # 70B in int4 fits one 80 GB GPU with room for KV


def test_dtype_fp8_is_an_alias_for_fp8_weights() -> None:
    assert Precision.of(dtype="fp8") == Precision(dtype="bfloat16", quantization="fp8")
    assert Precision.of(dtype="fp8", quantization="fp8", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="activation dtype must be one of bfloat16, float16, float32, got 'int8'"):
        Precision(dtype="int8")
    assert (
        Precision(quantization="int4", kv_cache_dtype="fp8").label
        == "bfloat16, int4 weights (W4A16 g128), fp8 KV cache"
    )


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_plan_priced_at_each_quantization_emits_a_manifest_the_api_accepts(quantization: str) -> None:
    kv = "fp8" if quantization in ("fp8", "int4") else "auto"
    perf = _llama8b(gpu="H200", quantization=quantization, kv_cache_dtype=kv)
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=4),
        prompt_tokens=LengthDist.parse("lognormal:1024:0.6"),
        output_tokens=LengthDist.parse("lognormal:128:0.6"),
    )
    requests = spec.generate(duration_seconds=20, seed=0)
    best = plan_all(
        PlanInputs(perf=perf, requests=requests, slo=Slo(ttft_p99_seconds=1, itl_p99_seconds=0.05)),
        compare_prefix_caching=False,
    ).best
    assert best is not None
    manifest = build_manifest(
        plan=best,
        name="quantized",
        model_uri="hf://meta-llama/Llama-3.1-8B",
        precision=perf.precision,
        min_replicas={},
        router_policy="least-load",
        memory_fraction=0.9,
        max_num_seqs=256,
        block_size=16,
    )
    isvc = InferenceService.parse(manifest)
    assert (isvc.spec.model.dtype, isvc.spec.model.quantization, isvc.spec.kv_cache.dtype) == (
        "bfloat16",
        quantization,
        kv,
    )


def test_cli_prices_and_emits_quantization_and_fp8_kv(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "isvc.yaml"
    argv = [
        "--gpu",
        "H200",
        "--rate",
        "4",
        "--duration-s",
        "20",
        "--quantization",
        "int8",
        "--kv-cache-dtype",
        "fp8",
        "--emit-manifest",
        str(path),
        "--name",
        "int8-plan",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "TP=1, bfloat16, int8 weights (W8A8), fp8 KV cache, roofline on H200" in out
    assert "WHAT-IF" not in out and "\nchosen:" in out
    obj = yaml.safe_load(path.read_text())
    assert obj["spec"]["model"]["quantization"] == "int8" and obj["spec"]["kvCache"]["dtype"] == "fp8"
    assert InferenceService.parse(obj).spec.kv_cache.dtype == "fp8"
