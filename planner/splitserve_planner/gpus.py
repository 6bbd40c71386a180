"""Accelerator specs for the roofline model, with the efficiencies a good engine reaches.

Peak numbers are vendor datasheet values (dense, no sparsity), per GPU:
NVIDIA H100 SXM5 / H100 PCIe / H200 SXM / A100 SXM4 80GB / L40S / A10G / B200 datasheets.
The default efficiencies are the fraction of peak a whole engine step reaches, chosen from the
team's research notes (/work/shared/research/runtime-anchors.md §5): decode steps reach about
75–85 % of spec HBM bandwidth (gpt-fast 69 % on A100, FlashInfer ~100 % for attention alone;
H200 measured copy 4.3 of 4.8 TB/s), prefill 55–65 % MFU (H200 measured bf16 matmul 790 of
989 TFLOP/s, FA3 75 % of peak for attention). ``step_overhead_seconds`` is the per-step cost
that does not shrink with bandwidth (launches, sampling, scheduling; CUDA graphs assumed).
Every value can be overridden from the command line; these are starting points, not truth.

Tensor-core peaks by operand type, dense (the datasheets print FP8/INT8 "with sparsity",
twice the dense figure; halved here): H100 SXM FP8 and INT8 3,958* -> 1,979 T; H100 PCIe
3,026* -> 1,513 T; H200 SXM as H100 SXM; A100 INT8 1,248* -> 624 TOPS, no FP8; L40S FP8 and
INT8 1,466* -> 733 T; A10 INT8 500* -> 250 TOPS, no FP8; HGX B200 per GPU FP8 and INT8 9 P* ->
4.5 P. W8A8 int8 GEMMs run at the INT8 rate, W8A8 fp8 ones at the FP8 rate
(:mod:`.precision`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator type."""

    name: str
    memory_bytes: int
    hbm_bytes_per_second: float
    bf16_flops_per_second: float
    fp8_flops_per_second: float | None
    """None: no FP8 tensor cores (A100, A10G)."""
    int8_ops_per_second: float
    """Dense INT8 tensor-core ops/s (W8A8 int8 GEMMs)."""
    interconnect_bytes_per_second: float
    """Intra-node GPU-to-GPU bandwidth (NVLink or PCIe), used for tensor-parallel all-reduce."""
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_seconds: float = 0.0005
    source: str = ""

    @property
    def has_fp8(self) -> bool:
        """FP8 (e4m3) tensor cores and conversions: Ada, Hopper, Blackwell."""
        return self.fp8_flops_per_second is not None

    def flops_per_second(self, *, dtype: str) -> float:
        """Peak dense tensor-core ops/s for GEMM operands of ``dtype``: ``bfloat16``,
        ``float16``, ``float32`` (run as TF32: half the bf16 rate), ``fp8`` or ``int8``."""
        if dtype == "fp8":
            if self.fp8_flops_per_second is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores")
            return self.fp8_flops_per_second
        if dtype == "int8":
            return self.int8_ops_per_second
        if dtype == "float32":
            return self.bf16_flops_per_second / 2
        if dtype in ("bfloat16", "float16"):
            return self.bf16_flops_per_second
        raise ValueError(f"no tensor-core rate for {dtype!r}; known: bfloat16, float16, float32, fp8, int8")


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            name="H100-SXM",
            memory_bytes=80 * 10**9,
            hbm_bytes_per_second=3.35e12,
            bf16_flops_per_second=989e12,
            fp8_flops_per_second=1979e12,
            int8_ops_per_second=1979e12,
            interconnect_bytes_per_second=450e9,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, 989 TF bf16 dense, NVLink 900 GB/s bidirectional)",
        ),
        GpuSpec(
            name="H100-PCIe",
            memory_bytes=80 * 10**9,
            hbm_bytes_per_second=2.0e12,
            bf16_flops_per_second=756e12,
            fp8_flops_per_second=1513e12,
            int8_ops_per_second=1513e12,
            interconnect_bytes_per_second=64e9,
            source="NVIDIA H100 datasheet (PCIe: 80 GB HBM2e, 2.0 TB/s, 756 TF bf16 dense, PCIe Gen5)",
        ),
        GpuSpec(
            name="H200",
            memory_bytes=141 * 10**9,
            hbm_bytes_per_second=4.8e12,
            bf16_flops_per_second=989e12,
            fp8_flops_per_second=1979e12,
            int8_ops_per_second=1979e12,
            interconnect_bytes_per_second=450e9,
            source="NVIDIA H200 datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, 989 TF bf16 dense); team measured 4.3 TB/s copy, 790 TF matmul",
        ),
        GpuSpec(
            name="A100-80GB",
            memory_bytes=80 * 10**9,
            hbm_bytes_per_second=2.039e12,
            bf16_flops_per_second=312e12,
            fp8_flops_per_second=None,
            int8_ops_per_second=624e12,
            interconnect_bytes_per_second=300e9,
            source="NVIDIA A100 datasheet (SXM4 80 GB HBM2e, 2,039 GB/s, 312 TF bf16 dense, NVLink 600 GB/s bidirectional)",
        ),
        GpuSpec(
            name="L40S",
            memory_bytes=48 * 10**9,
            hbm_bytes_per_second=864e9,
            bf16_flops_per_second=362e12,
            fp8_flops_per_second=733e12,
            int8_ops_per_second=733e12,
            interconnect_bytes_per_second=32e9,
            step_overhead_seconds=0.0008,
            source="NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s, 362 TF bf16 dense, PCIe Gen4)",
        ),
        GpuSpec(
            name="A10G",
            memory_bytes=24 * 10**9,
            hbm_bytes_per_second=600e9,
            bf16_flops_per_second=125e12,
            fp8_flops_per_second=None,
            int8_ops_per_second=250e12,
            interconnect_bytes_per_second=16e9,
            step_overhead_seconds=0.001,
            source="NVIDIA A10 datasheet (24 GB GDDR6, 600 GB/s, 125 TF bf16 dense); AWS g5 A10G",
        ),
        GpuSpec(
            name="B200",
            memory_bytes=180 * 10**9,
            hbm_bytes_per_second=8.0e12,
            bf16_flops_per_second=2250e12,
            fp8_flops_per_second=4500e12,
            int8_ops_per_second=4500e12,
            interconnect_bytes_per_second=900e9,
            source="NVIDIA DGX B200 / HGX B200 datasheet (180 GB HBM3e usable, 8 TB/s, 2.25 PF bf16 dense, NVLink 5 1.8 TB/s bidirectional)",
        ),
    )
}

_ALIASES = {"H100": "H100-SXM", "H200-SXM": "H200", "A100": "A100-80GB"}


def known_gpus() -> list[str]:
    return sorted(GPUS)


def get_gpu(name: str) -> GpuSpec:
    """The spec for ``name`` (case-insensitive, a few aliases); ValueError lists the known ones."""
    wanted = name.strip().upper()
    for key, spec in GPUS.items():
        if key.upper() == wanted:
            return spec
    for alias, key in _ALIASES.items():
        if alias.upper() == wanted:
            return GPUS[key]
    raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(known_gpus())}")
