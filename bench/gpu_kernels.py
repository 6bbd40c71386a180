"""GPU benchmark of the Triton kernels at Llama-3.1-8B shapes, with baselines in the same run.

Shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, KV block 16, hidden 4096,
intermediate 14336. Every figure is a ratio against something measured in the same process
(docs/architecture.md, "Performance method"):

* decode attention, batch {1, 8, 32, 64} x context {1k, 4k, 16k, 32k}: achieved HBM GB/s
  (K+V+q+out bytes / time) vs the 4.3 TB/s measured copy bandwidth of an H200, and vs torch
  SDPA on the same K/V gathered into contiguous tensors (no paging) - target >= 85% of
  bandwidth at >= 4k context;
* prefill attention, prompt {512, 2k, 8k} (8192 tokens per step: 8192 / prompt sequences),
  plus one extend chunk on a cached prefix: TFLOP/s vs SDPA (flash) and vs 790 TFLOP/s;
* RMSNorm, fused add + RMSNorm, SiLU-and-mul, RoPE, KV write: GB/s vs the torch backend.
* quantized GEMMs (fp8 W8A8, int8 W8A8, int8 W8A16, int4 W4A16 group 128) of a K=4096 layer,
  N {4096, 14336}, M decode-like {1, 16, 64} and prefill-like {2048, 8192}: TFLOP/s side by
  side with the bf16 cuBLAS GEMM (``F.linear``) and cuBLASLt fp8 (``torch._scaled_mm``, row-wise
  scales, GEMM only), as a fraction of peak (790 bf16, 2 x that for 8-bit operands), and the
  weight-streaming GB/s of the decode shapes vs HBM; every output is checked against
  ``quant/reference.py``.

Correctness comes first: a mixed prefill + decode step is checked against the torch backend,
and every benchmarked attention output against its SDPA baseline; failures are reported in
the JSON and the exit status is 1. A kernel that fails to compile is recorded as an error and
the run goes on.

    python bench/gpu_kernels.py [--sweep]          # on the GPU; writes $OUT/gpu_kernels.json
    python bench/gpu_kernels.py --smoke            # CPU, TRITON_INTERPRET=1, tiny shapes
    python bench/gpu_kernels.py --compile-only     # no GPU needed: compile for sm_90 (ptxas)

``--compile-only`` compiles every kernel ahead of time for an H200 (``GPUTarget("cuda", 90,
32)``) with the specialisations the JIT would apply (16-aligned pointers and strides), runs
ptxas, and reports shared memory and whether the K/V loads got software-pipelined
(``async_copy`` in the TTGIR), so GPU-only compile errors show up on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HBM_GBPS = 4300.0  # measured copy bandwidth, H200
PEAK_TFLOPS = 790.0  # measured dense bf16 matmul, H200
PEAK_TFLOPS_8BIT = 2 * PEAK_TFLOPS  # Hopper's fp8/int8 tensor-core rate is twice bf16's
DECODE_TARGET = 0.85
GEMM_KINDS = ("fp8", "int8", "w8a16", "w4a16")


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    intermediate: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    prefill_tokens: int
    extend: tuple[int, int]  # (new tokens, cached prefix)
    elementwise_tokens: int
    gemm_k: int
    gemm_ns: tuple[int, ...]
    gemm_ms: tuple[int, ...]  # decode-like then prefill-like row counts
    int4_group: int


FULL = Shapes(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    hidden=4096,
    intermediate=14336,
    decode_batches=(1, 8, 32, 64),
    decode_contexts=(1024, 4096, 16384, 32768),
    prefill_lens=(512, 2048, 8192),
    prefill_tokens=8192,
    extend=(512, 7680),
    elementwise_tokens=8192,
    gemm_k=4096,
    gemm_ns=(4096, 14336),
    gemm_ms=(1, 16, 64, 2048, 8192),
    int4_group=128,
)
SMOKE = Shapes(
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    block_size=16,
    hidden=256,
    intermediate=192,
    decode_batches=(1, 3),
    decode_contexts=(17, 40),
    prefill_lens=(20, 33),
    prefill_tokens=40,
    extend=(9, 23),
    elementwise_tokens=5,
    gemm_k=256,
    gemm_ns=(96,),
    gemm_ms=(1, 7, 80),
    int4_group=64,
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, correctness only; runs on CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep tile sizes / warps / stages for decode and prefill"
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="compile all kernels for sm_90 without a GPU and exit"
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", "./out"),
        help="output folder for gpu_kernels.json (default $OUT or ./out)",
    )
    return parser.parse_args()


class Bench:
    """Runs the sections, keeps the records and the correctness verdict."""

    def __init__(self, *, shapes: Shapes, smoke: bool, device: Any) -> None:
        import torch

        self.torch = torch
        self.shapes = shapes
        self.smoke = smoke
        self.device = device
        self.dtype = torch.bfloat16
        self.records: dict[str, list[dict[str, Any]]] = {
            "correctness": [],
            "decode": [],
            "prefill": [],
            "elementwise": [],
            "launch": [],
            "sweep": [],
            "gemm": [],
        }
        self.failures: list[str] = []

    # ------------------------------------------------------------------ helpers
    def time_ms(self, fn: Callable[[], Any]) -> float | None:
        """Median time in ms (cold L2 between runs, triton.testing.do_bench); None in smoke."""
        if self.smoke:
            fn()
            return None
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def time_graph_ms(self, fn: Callable[[], Any]) -> float | None:
        """Median ms of a CUDA-graph replay (no launch overhead; L2 stays warm, so K/V that fit
        in the 50 MB L2 read faster than HBM). None in smoke mode or if capture fails."""
        if self.smoke:
            return None
        import triton.testing

        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
        except Exception as exc:
            print(f"   (cuda graph timing failed: {type(exc).__name__}: {exc})", file=sys.stderr)
            return None

    def host_us_per_call(self, fn: Callable[[], Any], *, calls: int = 200) -> float | None:
        """Host-side launch cost: wall time per call of back-to-back tiny launches."""
        fn()
        if self.smoke:
            return None
        self.torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - started
        self.torch.cuda.synchronize()
        return elapsed / calls * 1e6

    def check(self, *, name: str, got: Any, ref: Any, atol: float, rtol: float = 0.0) -> float:
        """Elementwise ``|got - ref| <= atol + rtol * |ref|``; records and returns max abs err."""
        diff = (got.float() - ref.float()).abs()
        err = float(diff.max()) if got.numel() else 0.0
        bound = atol + rtol * ref.float().abs()
        ok = math.isfinite(err) and bool((diff <= bound).all())
        self.records["correctness"].append({"check": name, "max_abs_err": err, "atol": atol, "rtol": rtol, "ok": ok})
        if not ok:
            self.failures.append(f"{name}: max abs err {err:.3g} beyond atol {atol} rtol {rtol}")
        return err

    def guarded(self, section: str, label: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a compile or launch failure must not lose the other figures
            self.records[section].append(
                {"case": label, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}
            )
            if section != "sweep":  # a sweep config may just exceed shared memory
                self.failures.append(f"{section}/{label}: {type(exc).__name__}: {exc}")
            print(f"!! {section}/{label}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def paged_cache(self, *, num_tokens: int) -> tuple[Any, Any, int]:
        s, torch = self.shapes, self.torch
        num_blocks = math.ceil(num_tokens / s.block_size) + 1
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        k = torch.randn(shape, device=self.device, dtype=self.dtype)
        v = torch.randn(shape, device=self.device, dtype=self.dtype)
        return k, v, num_blocks

    def block_tables(self, *, batch: int, context: int, num_blocks: int) -> Any:
        """Each sequence gets scattered blocks (a random permutation), like a busy server."""
        per_seq = math.ceil(context / self.shapes.block_size)
        perm = self.torch.randperm(num_blocks, device=self.device)[: batch * per_seq]
        return perm.view(batch, per_seq).to(self.torch.int32).contiguous()

    def gather(self, cache: Any, tables: Any, context: int) -> Any:
        """``[batch, kv_heads, context, head_dim]`` contiguous copy for the SDPA baselines."""
        s = self.shapes
        pos = self.torch.arange(context, device=self.device)
        blocks = tables.long()[:, pos // s.block_size]
        rows = cache[blocks, (pos % s.block_size).expand_as(blocks)]  # [B, L, Hkv, D]
        return rows.transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ sections
    def mixed_step_vs_torch_backend(self) -> None:
        """One random step (prefix-cached prefill, fresh prompt, decodes) through both backends."""
        torch, s = self.torch, self.shapes
        from splitserve_runtime.ops.interface import AttentionMetadata
        from splitserve_runtime.ops.torch_backend import TorchOps
        from splitserve_runtime.ops.triton_backend import TritonOps

        prefills = [(9, 23), (33, 33)] if self.smoke else [(300, 1000), (517, 517), (1, 4097)]
        decodes = [1, 17, 40] if self.smoke else [1, 100, 2049, 4096, 5000]
        contexts = [c for _, c in prefills] + decodes
        q_lens = [q for q, _ in prefills] + [1] * len(decodes)
        k0, v0, num_blocks = self.paged_cache(num_tokens=sum(contexts) + 64)
        width = max(math.ceil(c / s.block_size) for c in contexts)
        perm = torch.randperm(num_blocks).tolist()
        tables = torch.zeros((len(contexts), width), dtype=torch.int32)
        slots: list[int] = []
        for b, (ctx, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
            blocks = [perm.pop() for _ in range(math.ceil(ctx / s.block_size))]
            tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            slots += [blocks[p // s.block_size] * s.block_size + p % s.block_size for p in range(ctx - q_len, ctx)]
        cu = [0]
        for q_len, _ in prefills:
            cu.append(cu[-1] + q_len)
        n_pre = len(prefills)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots + [-1], dtype=torch.int64, device=dev),
            num_prefills=n_pre,
            num_prefill_tokens=cu[-1],
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(contexts[:n_pre], dtype=torch.int32, device=dev),
            prefill_block_tables=tables[:n_pre].contiguous().to(dev),
            prefill_max_q_len=max(q_lens[:n_pre]),
            prefill_max_context_len=max(contexts[:n_pre]),
            num_decodes=len(decodes),
            decode_context_lens=torch.tensor(decodes, dtype=torch.int32, device=dev),
            decode_block_tables=tables[n_pre:].contiguous().to(dev),
            decode_max_context_len=max(decodes),
            block_size=s.block_size,
        )
        num_tokens = len(slots) + 1
        hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = torch.randn((num_tokens, hq + 2 * hkv, d), device=dev, dtype=self.dtype)
        q, key, value = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        outs = {}
        for ops in (TorchOps(), TritonOps()):
            k_cache, v_cache = k0.clone(), v0.clone()
            ops.write_kv_cache(key, value, k_cache, v_cache, md.slot_mapping)
            pre = ops.prefill_attention(q[: cu[-1]], k_cache, v_cache, md, d**-0.5)
            dec = ops.decode_attention(q[cu[-1] : cu[-1] + len(decodes)], k_cache, v_cache, md, d**-0.5)
            outs[ops.name] = (k_cache, v_cache, pre, dec)
        for i, name in enumerate(("kv_write.k", "kv_write.v", "prefill", "decode")):
            self.check(
                name=f"mixed_step.{name}", got=outs["triton"][i], ref=outs["torch"][i], atol=0.0 if i < 2 else 2e-2
            )

    def decode(self, *, sweep: bool) -> None:
        torch, s = self.torch, self.shapes
        from splitserve_runtime.kernels.decode_attention import decode_attention

        max_tokens = max(s.decode_batches) * max(s.decode_contexts)
        k_cache, v_cache, num_blocks = self.paged_cache(num_tokens=max_tokens)
        group = s.num_heads // s.num_kv_heads
        scale = s.head_dim**-0.5
        for batch in s.decode_batches:
            for context in s.decode_contexts:

                def case(batch: int = batch, context: int = context) -> None:
                    tables = self.block_tables(batch=batch, context=context, num_blocks=num_blocks)
                    lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
                    q = torch.randn((batch, s.num_heads, s.head_dim), device=self.device, dtype=self.dtype)

                    def ours() -> Any:
                        return decode_attention(
                            q=q,
                            k_cache=k_cache,
                            v_cache=v_cache,
                            block_tables=tables,
                            context_lens=lens,
                            max_context_len=context,
                            scale=scale,
                        )

                    k = self.gather(k_cache, tables, context)
                    v = self.gather(v_cache, tables, context)
                    qg = q.view(batch, s.num_kv_heads, group, s.head_dim)

                    def sdpa() -> Any:  # the group's queries as rows: no GQA expansion needed
                        return torch.nn.functional.scaled_dot_product_attention(qg, k, v, scale=scale)

                    ref = sdpa().reshape(batch, s.num_heads, s.head_dim)
                    err = self.check(name=f"decode.b{batch}.ctx{context}", got=ours(), ref=ref, atol=2e-2)
                    t_ours, t_sdpa = self.time_ms(ours), self.time_ms(sdpa)
                    t_graph = self.time_graph_ms(ours)
                    nbytes = (
                        2 * batch * context * s.num_kv_heads * s.head_dim + 2 * batch * s.num_heads * s.head_dim
                    ) * 2
                    self.records["decode"].append(
                        _bandwidth_row(
                            case=f"b{batch} ctx{context}",
                            nbytes=nbytes,
                            t_ours=t_ours,
                            t_base=t_sdpa,
                            extra={
                                "batch": batch,
                                "context": context,
                                "max_abs_err": err,
                                "graph_ms": t_graph,
                                "graph_GBps": nbytes / (t_graph * 1e6) if t_graph else None,
                            },
                        )
                    )

                self.guarded("decode", f"b{batch} ctx{context}", case)
        if sweep and not self.smoke:
            for batch, context in ((1, 16384), (32, 4096)):
                self._decode_sweep(
                    batch=batch, context=context, k_cache=k_cache, v_cache=v_cache, num_blocks=num_blocks
                )

    def _decode_sweep(self, *, batch: int, context: int, k_cache: Any, v_cache: Any, num_blocks: int) -> None:
        torch, s = self.torch, self.shapes
        from splitserve_runtime.kernels.decode_attention import decode_attention

        tables = self.block_tables(batch=batch, context=context, num_blocks=num_blocks)
        lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
        q = torch.randn((batch, s.num_heads, s.head_dim), device=self.device, dtype=self.dtype)
        nbytes = 2 * batch * context * s.num_kv_heads * s.head_dim * 2
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):

                    def run(b: int = block_n, w: int = warps, st: int = stages) -> None:
                        ms = self.time_ms(
                            lambda: decode_attention(
                                q=q,
                                k_cache=k_cache,
                                v_cache=v_cache,
                                block_tables=tables,
                                context_lens=lens,
                                max_context_len=context,
                                scale=s.head_dim**-0.5,
                                block_n=b,
                                num_warps=w,
                                num_stages=st,
                            )
                        )
                        self.records["sweep"].append(
                            {
                                "case": f"decode b{batch} ctx{context}",
                                "block_n": b,
                                "num_warps": w,
                                "num_stages": st,
                                "ms": ms,
                                "GBps": nbytes / (ms * 1e6) if ms else None,
                            }
                        )

                    self.guarded("sweep", f"decode {block_n}/{warps}/{stages}", run)

    def prefill(self, *, sweep: bool) -> None:
        torch, s = self.torch, self.shapes
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from splitserve_runtime.kernels.kv_cache_write import write_kv_cache
        from splitserve_runtime.kernels.prefill_attention import prefill_attention

        group = s.num_heads // s.num_kv_heads
        scale = s.head_dim**-0.5
        cases = [(length, length) for length in s.prefill_lens] + [(s.extend[0], s.extend[0] + s.extend[1])]
        for q_len, context in cases:

            def case(q_len: int = q_len, context: int = context) -> None:
                batch = max(1, s.prefill_tokens // context)
                k_cache, v_cache, num_blocks = self.paged_cache(num_tokens=batch * context)
                tables = self.block_tables(batch=batch, context=context, num_blocks=num_blocks)
                lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
                cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=self.device)
                q = torch.randn((batch * q_len, s.num_heads, s.head_dim), device=self.device, dtype=self.dtype)
                # This step's own K/V go through the write kernel into their slots.
                pos = torch.arange(context - q_len, context, device=self.device)
                slots = (tables.long()[:, pos // s.block_size] * s.block_size + pos % s.block_size).reshape(-1)
                kv_new = torch.randn(
                    (2, batch * q_len, s.num_kv_heads, s.head_dim), device=self.device, dtype=self.dtype
                )
                write_kv_cache(key=kv_new[0], value=kv_new[1], k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)

                def ours() -> Any:
                    return prefill_attention(
                        q=q,
                        k_cache=k_cache,
                        v_cache=v_cache,
                        block_tables=tables,
                        context_lens=lens,
                        cu_seqlens_q=cu,
                        max_q_len=q_len,
                        max_context_len=context,
                        scale=scale,
                    )

                k = self.gather(k_cache, tables, context).repeat_interleave(group, dim=1)
                v = self.gather(v_cache, tables, context).repeat_interleave(group, dim=1)
                qb = q.view(batch, q_len, s.num_heads, s.head_dim).transpose(1, 2)
                # Causal with the offset context - q_len (bottom-right aligned).
                offset = context - q_len
                mask = (
                    torch.arange(context, device=self.device)[None, :]
                    <= torch.arange(q_len, device=self.device)[:, None] + offset
                )
                fresh = q_len == context

                def sdpa() -> Any:
                    if fresh:
                        backends = [SDPBackend.FLASH_ATTENTION] if not self.smoke else [SDPBackend.MATH]
                        with sdpa_kernel(backends):
                            return torch.nn.functional.scaled_dot_product_attention(
                                qb, k, v, is_causal=True, scale=scale
                            )
                    return torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)

                ref = sdpa().transpose(1, 2).reshape(q.shape)
                err = self.check(name=f"prefill.q{q_len}.ctx{context}", got=ours(), ref=ref, atol=2e-2)
                t_ours = self.time_ms(ours)
                t_sdpa = self.time_ms(sdpa) if fresh else None  # masked SDPA is no flash baseline
                # Causal FLOPs: QK^T and PV, 2 flops per MAC, visible (row, key) pairs only.
                pairs = q_len * offset + q_len * (q_len + 1) // 2
                flops = batch * 4 * pairs * s.head_dim * s.num_heads
                row: dict[str, Any] = {
                    "case": f"q{q_len} ctx{context} x{batch}",
                    "batch": batch,
                    "q_len": q_len,
                    "context": context,
                    "max_abs_err": err,
                    "ms": t_ours,
                    "sdpa_ms": t_sdpa,
                }
                if t_ours:
                    row["TFLOPs"] = flops / (t_ours * 1e9)
                    row["MFU"] = row["TFLOPs"] / PEAK_TFLOPS
                if t_ours and t_sdpa:
                    row["sdpa_TFLOPs"] = flops / (t_sdpa * 1e9)
                    row["vs_sdpa"] = t_sdpa / t_ours
                self.records["prefill"].append(row)
                if sweep and not self.smoke and q_len == max(s.prefill_lens):
                    for bm in (64, 128):
                        for bn in (32, 64, 128):
                            for warps in (4, 8):
                                for stages in (2, 3):

                                    def run(bm: int = bm, bn: int = bn, w: int = warps, st: int = stages) -> None:
                                        ms = self.time_ms(
                                            lambda: prefill_attention(
                                                q=q,
                                                k_cache=k_cache,
                                                v_cache=v_cache,
                                                block_tables=tables,
                                                context_lens=lens,
                                                cu_seqlens_q=cu,
                                                max_q_len=q_len,
                                                max_context_len=context,
                                                scale=scale,
                                                block_m=bm,
                                                block_n=bn,
                                                num_warps=w,
                                                num_stages=st,
                                            )
                                        )
                                        self.records["sweep"].append(
                                            {
                                                "case": f"prefill q{q_len}",
                                                "block_m": bm,
                                                "block_n": bn,
                                                "num_warps": w,
                                                "num_stages": st,
                                                "ms": ms,
                                                "TFLOPs": flops / (ms * 1e9) if ms else None,
                                            }
                                        )

                                    self.guarded("sweep", f"prefill {bm}/{bn}/{warps}/{stages}", run)

            self.guarded("prefill", f"q{q_len} ctx{context}", case)

    def elementwise(self) -> None:
        torch, s = self.torch, self.shapes
        from splitserve_runtime.kernels.activation import silu_and_mul
        from splitserve_runtime.kernels.kv_cache_write import write_kv_cache
        from splitserve_runtime.kernels.rmsnorm import fused_add_rms_norm, rms_norm
        from splitserve_runtime.kernels.rotary import rotary_embedding
        from splitserve_runtime.ops.torch_backend import TorchOps

        ref_ops = TorchOps()
        t, h, inter, dev, dt = (s.elementwise_tokens, s.hidden, s.intermediate, self.device, self.dtype)
        x = torch.randn((t, h), device=dev, dtype=dt)
        res = torch.randn((t, h), device=dev, dtype=dt)
        w = torch.rand(h, device=dev, dtype=dt) + 0.5
        gate_up = torch.randn((t, 2 * inter), device=dev, dtype=dt)
        hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = torch.randn((t, hq + 2 * hkv, d), device=dev, dtype=dt)
        q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
        positions = torch.randint(0, 8192, (t,), device=dev)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
        freqs = torch.outer(torch.arange(8192, device=dev).float(), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        k_cache, v_cache, num_blocks = self.paged_cache(num_tokens=t)
        slots = torch.randperm(num_blocks * s.block_size, device=dev)[:t]
        eb = 2  # bytes per bf16 element
        cases: list[tuple[str, Callable[[], Any], Callable[[], Any], int, float]] = [
            (
                "rms_norm",
                lambda: rms_norm(x=x, weight=w, eps=1e-5),
                lambda: ref_ops.rms_norm(x, w, 1e-5),
                2 * t * h * eb,
                1e-2,
            ),
            (
                "fused_add_rms_norm",
                lambda: fused_add_rms_norm(x=x, residual=res, weight=w, eps=1e-5)[0],
                lambda: ref_ops.fused_add_rms_norm(x, res, w, 1e-5)[0],
                4 * t * h * eb,
                1e-2,
            ),
            (
                "silu_and_mul",
                lambda: silu_and_mul(x=gate_up),
                lambda: ref_ops.silu_and_mul(gate_up),
                3 * t * inter * eb,
                1e-2,
            ),
            (
                "rotary",
                lambda: rotary_embedding(positions=positions, q=q, k=k, cos_sin_cache=cos_sin)[0],
                lambda: ref_ops.rotary_embedding(positions, q, k, cos_sin)[0],
                2 * t * (hq + hkv) * d * eb,
                1e-2,
            ),
        ]
        for name, ours, ref, nbytes, atol in cases:

            def case(
                name: str = name,
                ours: Callable[[], Any] = ours,
                ref: Callable[[], Any] = ref,
                nbytes: int = nbytes,
                atol: float = atol,
            ) -> None:
                # bf16 outputs: ~2 ulps relative (the interpreter truncates where the GPU rounds).
                err = self.check(name=f"elementwise.{name}", got=ours(), ref=ref(), atol=atol, rtol=1.6e-2)
                self.records["elementwise"].append(
                    _bandwidth_row(
                        case=name,
                        nbytes=nbytes,
                        t_ours=self.time_ms(ours),
                        t_base=self.time_ms(ref),
                        extra={"tokens": t, "max_abs_err": err},
                    )
                )

            self.guarded("elementwise", name, case)

        def kv_case() -> None:
            key, value = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
            kc, vc = k_cache.clone(), v_cache.clone()
            write_kv_cache(key=key, value=value, k_cache=kc, v_cache=vc, slot_mapping=slots)
            rk, rv = k_cache.clone(), v_cache.clone()
            ref_ops.write_kv_cache(key, value, rk, rv, slots)
            self.check(name="elementwise.write_kv_cache.k", got=kc, ref=rk, atol=0.0)
            self.check(name="elementwise.write_kv_cache.v", got=vc, ref=rv, atol=0.0)
            self.records["elementwise"].append(
                _bandwidth_row(
                    case="write_kv_cache",
                    nbytes=4 * t * hkv * d * eb,
                    t_ours=self.time_ms(
                        lambda: write_kv_cache(key=key, value=value, k_cache=kc, v_cache=vc, slot_mapping=slots)
                    ),
                    t_base=self.time_ms(lambda: ref_ops.write_kv_cache(key, value, rk, rv, slots)),
                    extra={"tokens": t},
                )
            )

        self.guarded("elementwise", "write_kv_cache", kv_case)

    def gemm_weights(self, n: int, k: int) -> dict[str, Any]:
        """A random ``[n, k]`` weight in bf16 and in each quantized layout (round to nearest:
        fp8 and int8 per output channel, int4 asymmetric per group of ``int4_group``)."""
        torch = self.torch
        from splitserve_runtime.quant.formats import (
            FP8_DTYPE,
            Fp8Weight,
            Int4Weight,
            Int8Weight,
            pack_int4,
        )

        dense = torch.randn((n, k), device=self.device) * 0.02
        fp8_scale = dense.abs().amax(dim=1) / 448.0
        int8_scale = dense.abs().amax(dim=1) / 127.0
        int8 = torch.round(dense / int8_scale[:, None]).clamp(-127, 127).to(torch.int8)
        group = self.shapes.int4_group
        grouped = dense.t().reshape(k // group, group, n)
        low, high = grouped.amin(dim=1), grouped.amax(dim=1)
        scales = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((grouped - low[:, None]) / scales[:, None]).clamp(0, 15).reshape(k, n)
        return {
            "bf16": dense.to(self.dtype),
            "fp8": Fp8Weight(qweight=(dense / fp8_scale[:, None]).to(FP8_DTYPE), weight_scale=fp8_scale),
            "int8": Int8Weight(qweight=int8, weight_scale=int8_scale, act_quant=True),
            "w8a16": Int8Weight(qweight=int8, weight_scale=int8_scale, act_quant=False),
            "w4a16": Int4Weight(
                qweight=pack_int4(q), scales=scales.to(self.dtype), offsets=low.to(self.dtype), group_size=group
            ),
        }

    def gemm(self, *, sweep: bool) -> None:
        """Quantized GEMMs (through ``TritonOps.linear``) vs bf16 ``F.linear`` and cuBLASLt fp8."""
        torch, s = self.torch, self.shapes
        from splitserve_runtime.kernels.scaled_gemm import scaled_gemm
        from splitserve_runtime.ops.triton_backend import TritonOps
        from splitserve_runtime.quant.formats import weight_nbytes
        from splitserve_runtime.quant.reference import quant_linear, quantize_per_token_fp8

        ops, k = TritonOps(), s.gemm_k
        for n in s.gemm_ns:
            weights = self.gemm_weights(n, k)
            for m in s.gemm_ms:

                def case(n: int = n, m: int = m, weights: dict[str, Any] = weights) -> None:
                    x = torch.randn((m, k), device=self.device, dtype=self.dtype)
                    dense, fp8 = weights["bf16"], weights["fp8"]
                    row: dict[str, Any] = {"case": f"m{m} n{n} k{k}", "m": m, "n": n, "k": k}
                    timings: dict[str, float | None] = {
                        "bf16": self.time_ms(lambda: torch.nn.functional.linear(x, dense))
                    }
                    for kind in GEMM_KINDS:

                        def ours(w: Any = weights[kind]) -> Any:
                            return ops.linear(x, w, None)

                        row[f"{kind}_max_abs_err"] = self.check(
                            name=f"gemm.{kind}.m{m}.n{n}",
                            got=ours(),
                            ref=quant_linear(x, weights[kind], None),
                            atol=2e-2,
                            rtol=1.6e-2,
                        )
                        timings[kind] = self.time_ms(ours)
                    # The fp8 GEMM alone (activations already quantized), as cuBLASLt gets it.
                    xq, x_scale = quantize_per_token_fp8(x)
                    x_scale_1d = x_scale.reshape(-1).contiguous()

                    def fp8_gemm() -> Any:
                        return scaled_gemm(
                            a=xq,
                            a_scale=x_scale_1d,
                            b=fp8.qweight,
                            b_scale=fp8.weight_scale,
                            bias=None,
                            out_dtype=self.dtype,
                        )

                    row["fp8_gemm_max_abs_err"] = self.check(
                        name=f"gemm.fp8_gemm.m{m}.n{n}",
                        got=fp8_gemm(),
                        ref=quant_linear(x, fp8, None),
                        atol=2e-2,
                        rtol=1.6e-2,
                    )
                    timings["fp8_gemm"] = self.time_ms(fp8_gemm)

                    def fp8_fast() -> Any:
                        return scaled_gemm(
                            a=xq,
                            a_scale=x_scale_1d,
                            b=fp8.qweight,
                            b_scale=fp8.weight_scale,
                            bias=None,
                            out_dtype=self.dtype,
                            fast_accum=True,
                        )

                    # Informational: Hopper's imprecise fp8 accumulation may exceed the bound.
                    row["fp8_fast_max_abs_diff"] = float((fp8_fast().float() - fp8_gemm().float()).abs().max())
                    timings["fp8_fast"] = self.time_ms(fp8_fast)
                    if not self.smoke:

                        def cublas() -> Any:
                            return torch._scaled_mm(
                                xq,
                                fp8.qweight.t(),
                                scale_a=x_scale,
                                scale_b=fp8.weight_scale[None, :],
                                out_dtype=self.dtype,
                            )

                        try:
                            err = (cublas().float() - ops.linear(x, fp8, None).float()).abs()
                            row["cublas_fp8_max_abs_diff"] = float(err.max())
                            timings["cublas_fp8"] = self.time_ms(cublas)
                        except Exception as exc:  # row-wise fp8 needs aligned M on some builds
                            row["cublas_fp8_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    for kind, ms in timings.items():
                        row[f"{kind}_ms"] = ms
                        if not ms:
                            continue
                        tflops = 2 * m * n * k / (ms * 1e9)
                        eight_bit = kind in ("fp8", "fp8_gemm", "fp8_fast", "cublas_fp8", "int8")
                        layout = weights["fp8" if "fp8" in kind else kind]
                        row[f"{kind}_TFLOPs"] = tflops
                        row[f"{kind}_frac_peak"] = tflops / (PEAK_TFLOPS_8BIT if eight_bit else PEAK_TFLOPS)
                        row[f"{kind}_weight_GBps"] = weight_nbytes(layout) / (ms * 1e6)
                        if timings["bf16"]:
                            row[f"{kind}_vs_bf16"] = timings["bf16"] / ms
                    self.records["gemm"].append(row)

                self.guarded("gemm", f"m{m} n{n} k{k}", case)
            if sweep and not self.smoke:
                self._gemm_sweep(n=n, k=k, weights=weights)

    def _gemm_sweep(self, *, n: int, k: int, weights: dict[str, Any]) -> None:
        """Tile / stage sweep of the fp8 and W4A16 GEMMs at one decode and one prefill M."""
        torch, s = self.torch, self.shapes
        from splitserve_runtime.kernels._gemm_common import GemmConfig
        from splitserve_runtime.kernels.scaled_gemm import w8a8_linear
        from splitserve_runtime.kernels.w4a16_gemm import w4a16_linear

        fp8, int4 = weights["fp8"], weights["w4a16"]
        decode_m, prefill_m = 16, max(s.gemm_ms)
        for m in (decode_m, prefill_m):
            x = torch.randn((m, k), device=self.device, dtype=self.dtype)
            for kind in ("fp8", "w4a16"):
                if m == decode_m:
                    configs = [
                        GemmConfig(block_m=16, block_n=bn, block_k=bk, group_m=1, num_warps=4, num_stages=st)
                        for bn in (32, 64, 128)
                        for bk in ((128, 256) if kind == "fp8" else (64, 128))
                        for st in (3, 5)
                    ]
                else:
                    configs = [
                        GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=w, num_stages=st)
                        for bm, bn in ((64, 128), (128, 128), (128, 256))
                        for bk in ((64, 128) if kind == "fp8" else (32, 64))
                        for w, st in ((4, 4), (8, 3), (8, 4))
                    ]
                for cfg in configs:

                    def run(cfg: GemmConfig = cfg, kind: str = kind, m: int = m, x: Any = x) -> None:
                        if kind == "fp8":
                            ms = self.time_ms(
                                lambda: w8a8_linear(
                                    x=x, qweight=fp8.qweight, weight_scale=fp8.weight_scale, bias=None, config=cfg
                                )
                            )
                        else:
                            ms = self.time_ms(
                                lambda: w4a16_linear(
                                    x=x,
                                    qweight=int4.qweight,
                                    scales=int4.scales,
                                    offsets=int4.offsets,
                                    group_size=int4.group_size,
                                    bias=None,
                                    config=cfg,
                                )
                            )
                        self.records["sweep"].append(
                            {
                                "case": f"gemm {kind} m{m} n{n}",
                                "block_m": cfg.block_m,
                                "block_n": cfg.block_n,
                                "block_k": cfg.block_k,
                                "num_warps": cfg.num_warps,
                                "num_stages": cfg.num_stages,
                                "ms": ms,
                                "TFLOPs": 2 * m * n * k / (ms * 1e9) if ms else None,
                            }
                        )

                    self.guarded("sweep", f"gemm {kind} m{m} {cfg}", run)

    def launch_overhead(self) -> None:
        """Host microseconds per call of each TritonOps op at batch-1 decode shapes."""
        torch, s = self.torch, self.shapes
        from splitserve_runtime.ops.interface import AttentionMetadata
        from splitserve_runtime.ops.triton_backend import TritonOps

        ops, dev, dt = TritonOps(), self.device, self.dtype
        context = 1024
        k_cache, v_cache, num_blocks = self.paged_cache(num_tokens=context)
        tables = self.block_tables(batch=1, context=context, num_blocks=num_blocks)
        empty_i32 = torch.zeros((0,), dtype=torch.int32, device=dev)
        md = AttentionMetadata(
            slot_mapping=torch.tensor([5], dtype=torch.int64, device=dev),
            num_prefills=0,
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_context_lens=empty_i32,
            prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
            prefill_max_q_len=0,
            prefill_max_context_len=0,
            num_decodes=1,
            decode_context_lens=torch.tensor([context], dtype=torch.int32, device=dev),
            decode_block_tables=tables,
            decode_max_context_len=context,
            block_size=s.block_size,
        )
        hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        q = torch.randn((1, hq, d), device=dev, dtype=dt)
        kv = torch.randn((1, hkv, d), device=dev, dtype=dt)
        x = torch.randn((1, s.hidden), device=dev, dtype=dt)
        w = torch.ones(s.hidden, device=dev, dtype=dt)
        gate_up = torch.randn((1, 2 * s.intermediate), device=dev, dtype=dt)
        positions = torch.zeros(1, dtype=torch.int64, device=dev)
        cos_sin = torch.randn((16, d), device=dev)
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("decode_attention", lambda: ops.decode_attention(q, k_cache, v_cache, md, 0.1)),
            ("write_kv_cache", lambda: ops.write_kv_cache(kv, kv, k_cache, v_cache, md.slot_mapping)),
            ("rms_norm", lambda: ops.rms_norm(x, w, 1e-5)),
            ("fused_add_rms_norm", lambda: ops.fused_add_rms_norm(x, x, w, 1e-5)),
            ("rotary_embedding", lambda: ops.rotary_embedding(positions, q, kv, cos_sin)),
            ("silu_and_mul", lambda: ops.silu_and_mul(gate_up)),
        ]
        quantized = self.gemm_weights(s.hidden, s.hidden)

        def linear_call(weight: Any) -> Callable[[], Any]:
            return lambda: ops.linear(x, weight, None)

        cases += [(f"linear_{kind}", linear_call(quantized[kind])) for kind in GEMM_KINDS]
        for name, fn in cases:

            def case(name: str = name, fn: Callable[[], Any] = fn) -> None:
                self.records["launch"].append({"case": name, "host_us_per_call": self.host_us_per_call(fn)})

            self.guarded("launch", name, case)


def _bandwidth_row(
    *, case: str, nbytes: int, t_ours: float | None, t_base: float | None, extra: dict[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case, "bytes": nbytes, "ms": t_ours, "base_ms": t_base, **extra}
    if t_ours:
        row["GBps"] = nbytes / (t_ours * 1e6)
        row["frac_hbm"] = row["GBps"] / HBM_GBPS
    if t_base:
        row["base_GBps"] = nbytes / (t_base * 1e6)
    if t_ours and t_base:
        row["speedup_vs_base"] = t_base / t_ours
    return row


def _fmt(value: Any, spec: str) -> str:
    width = int(spec.split(".")[0])
    return "-".rjust(width) if value is None else format(value, spec)


def _print_tables(records: dict[str, list[dict[str, Any]]]) -> None:
    print("\n== decode attention (base = SDPA on gathered K/V) ==")
    print(f"{'case':<18}{'ms':>9}{'GB/s':>9}{'%HBM':>7}{'sdpa ms':>9}{'x sdpa':>8}{'graph GB/s':>11}{'err':>9}")
    for r in records["decode"]:
        if "error" in r:
            print(f"{r['case']:<18} ERROR {r['error'][:80]}")
            continue
        pct = None if r.get("frac_hbm") is None else 100 * r["frac_hbm"]
        print(
            f"{r['case']:<18}{_fmt(r['ms'], '9.4f')}{_fmt(r.get('GBps'), '9.0f')}"
            f"{_fmt(pct, '7.1f')}{_fmt(r['base_ms'], '9.4f')}"
            f"{_fmt(r.get('speedup_vs_base'), '8.2f')}{_fmt(r.get('graph_GBps'), '11.0f')}"
            f"{r['max_abs_err']:9.1e}"
        )
    print("(graph = CUDA-graph replay: no launch gaps, warm L2 for K/V under ~50 MB)")
    print("\n== prefill attention (base = SDPA flash, causal) ==")
    print(f"{'case':<24}{'ms':>9}{'TFLOP/s':>9}{'MFU':>7}{'sdpa':>9}{'x sdpa':>8}{'err':>9}")
    for r in records["prefill"]:
        if "error" in r:
            print(f"{r['case']:<24} ERROR {r['error'][:80]}")
            continue
        mfu = None if r.get("MFU") is None else 100 * r["MFU"]
        print(
            f"{r['case']:<24}{_fmt(r['ms'], '9.3f')}{_fmt(r.get('TFLOPs'), '9.1f')}"
            f"{_fmt(mfu, '7.1f')}{_fmt(r.get('sdpa_TFLOPs'), '9.1f')}"
            f"{_fmt(r.get('vs_sdpa'), '8.2f')}{r['max_abs_err']:9.1e}"
        )
    print("\n== elementwise (base = torch backend, eager) ==")
    print(f"{'case':<20}{'ms':>9}{'GB/s':>9}{'%HBM':>7}{'torch GB/s':>11}{'x torch':>8}")
    for r in records["elementwise"]:
        if "error" in r:
            print(f"{r['case']:<20} ERROR {r['error'][:80]}")
            continue
        pct = None if r.get("frac_hbm") is None else 100 * r["frac_hbm"]
        print(
            f"{r['case']:<20}{_fmt(r['ms'], '9.4f')}{_fmt(r.get('GBps'), '9.0f')}"
            f"{_fmt(pct, '7.1f')}{_fmt(r.get('base_GBps'), '11.0f')}"
            f"{_fmt(r.get('speedup_vs_base'), '8.2f')}"
        )
    if records["launch"]:
        print("\n== host launch cost per call (batch-1 decode shapes) ==")
        for r in records["launch"]:
            print(
                f"{r['case']:<20}{_fmt(r.get('host_us_per_call'), '9.1f')} us"
                if "error" not in r
                else f"{r['case']:<20} ERROR {r['error'][:80]}"
            )
    if records["gemm"]:
        _print_gemm(records["gemm"])
    if records["sweep"]:
        print("\n== sweep (best per case) ==")
        best: dict[str, dict[str, Any]] = {}
        for r in records["sweep"]:
            if r.get("ms") and (r["case"] not in best or r["ms"] < best[r["case"]]["ms"]):
                best[r["case"]] = r
        for case, r in best.items():
            print(f"{case:<24}{json.dumps({k: v for k, v in r.items() if k != 'case'})}")
    bad = [r for r in records["correctness"] if not r["ok"]]
    print(f"\ncorrectness: {len(records['correctness']) - len(bad)}/{len(records['correctness'])} checks ok")
    for r in bad:
        print(f"  FAIL {r['check']}: max abs err {r['max_abs_err']:.3g} (atol {r['atol']}, rtol {r['rtol']})")


def _print_gemm(rows: list[dict[str, Any]]) -> None:
    kinds = ("bf16", "fp8", "fp8_gemm", "fp8_fast", "cublas_fp8", "int8", "w8a16", "w4a16")
    print(
        "\n== quantized GEMM TFLOP/s (x bf16 F.linear); fp8_gemm: without the activation "
        "quantization; fp8_fast: fp8_gemm with Hopper's imprecise accumulation; cublas_fp8: "
        "torch._scaled_mm =="
    )
    print(f"{'case':<20}" + "".join(f"{kind:>16}" for kind in kinds) + f"{'max err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<20} ERROR {r['error'][:80]}")
            continue
        line = "".join(
            f"{_fmt(r.get(f'{kind}_TFLOPs'), '8.1f')} ({_fmt(r.get(f'{kind}_vs_bf16'), '5.2f')})" for kind in kinds
        )
        errs = [v for key, v in r.items() if key.endswith("_max_abs_err")]
        print(f"{r['case']:<20}{line}{_fmt(max(errs) if errs else None, '9.1e')}")
    print(
        f"\n== quantized GEMM % of peak ({PEAK_TFLOPS:.0f} TFLOP/s bf16 and weight-only, "
        f"{PEAK_TFLOPS_8BIT:.0f} 8-bit) and weight GB/s (% of {HBM_GBPS:.0f} HBM) =="
    )
    print(f"{'case':<20}" + "".join(f"{kind:>16}" for kind in kinds))
    for r in rows:
        if "error" in r:
            continue
        cells: list[str] = []
        for kind in kinds:
            frac, gbps = r.get(f"{kind}_frac_peak"), r.get(f"{kind}_weight_GBps")
            pct = None if frac is None else 100 * frac
            hbm = None if gbps is None else 100 * gbps / HBM_GBPS
            cells.append(f"{_fmt(pct, '6.1f')}% {_fmt(hbm, '6.1f')}%")
        print(f"{r['case']:<20}" + "".join(f"{c:>16}" for c in cells))
    print("(first % = of peak FLOP/s: the prefill figure; second = weight bytes / time vs HBM: the decode figure)")


def _compile_gemms(build: Callable[..., None]) -> None:
    """The quantized GEMM kernels at their decode and prefill default configurations."""
    import triton.language as tl

    from splitserve_runtime.kernels import act_quant, scaled_gemm, w4a16_gemm, w8a16_gemm

    for qtype, fp8 in (("fp8e4nv", True), ("i8", False)):
        build(
            f"act_quant {qtype}",
            act_quant._act_quant_kernel,
            {
                "QMAX": 448.0 if fp8 else 127.0,
                "AMAX_FLOOR": act_quant.ACT_AMAX_FLOOR,
                "TO_FP8": fp8,
                "INTERPRET": False,
                "BLOCK_K": 4096,
            },
            "bf16",
            8,
            1,
            {"q_ptr": f"*{qtype}", "scale_ptr": "*fp32"},
        )
    tiles = ((16, 32, 256, 4), (128, 128, 128, 8))  # (BLOCK_M, BLOCK_N, BLOCK_K, warps)
    for qtype, acc in (("fp8e4nv", tl.float32), ("i8", tl.int32)):
        for bm, bn, bk, warps in tiles:
            build(
                f"scaled_gemm {qtype} {bm}x{bn}x{bk}",
                scaled_gemm._scaled_gemm_kernel,
                {
                    "HAS_BIAS": True,
                    "ACC_DTYPE": acc,
                    "EVEN_K": True,
                    "BLOCK_M": bm,
                    "IMPRECISE_ACC": bk if qtype == "fp8e4nv" else None,
                    "BLOCK_N": bn,
                    "BLOCK_K": bk,
                    "GROUP_M": 8,
                },
                "bf16",
                warps,
                4,
                {"a_ptr": f"*{qtype}", "b_ptr": f"*{qtype}", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32"},
            )
    weight_only = {"HAS_BIAS": True, "EVEN_K": True, "DOT_FP32": False, "INPUT_PRECISION": "tf32", "GROUP_M": 8}
    for bm, bn, bk, warps in ((16, 32, 128, 4), (128, 128, 64, 8)):
        build(
            f"w8a16 bf16 {bm}x{bn}x{bk}",
            w8a16_gemm._w8a16_kernel,
            {**weight_only, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
            "bf16",
            warps,
            4,
            {"w_ptr": "*i8", "w_scale_ptr": "*fp32"},
        )
        for one_group in (True, False):
            build(
                f"w4a16 bf16 {bm}x{bn}x{bk} one_group={one_group}",
                w4a16_gemm._w4a16_kernel,
                {
                    **weight_only,
                    "GROUP_SIZE": 128 if one_group else 32,
                    "ONE_GROUP_PER_TILE": one_group,
                    "BLOCK_M": bm,
                    "BLOCK_N": bn,
                    "BLOCK_K": bk,
                },
                "bf16",
                warps,
                4,
                {"qw_ptr": "*i32"},
            )


def _compile_only(out_dir: Path) -> int:
    """AOT-compile each kernel for sm_90 with JIT-like specialisation; no GPU needed."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from splitserve_runtime.kernels import activation, kv_cache_write, rmsnorm, rotary
    from splitserve_runtime.kernels import decode_attention as dec
    from splitserve_runtime.kernels import prefill_attention as pre

    target = GPUTarget("cuda", 90, 32)
    index_ptrs = {
        "block_tables_ptr": "*i32",
        "context_lens_ptr": "*i32",
        "cu_seqlens_ptr": "*i32",
        "slot_ptr": "*i64",
        "pos_ptr": "*i64",
        "cos_sin_ptr": "*fp32",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
    }
    floats = {"qk_scale", "eps", "v_scale", "inv_k_scale", "inv_v_scale"}
    rows: list[dict[str, Any]] = []
    failures = 0

    def build(
        label: str,
        fn: Any,
        consts: dict[str, Any],
        dtype: str,
        warps: int,
        stages: int,
        ptrs: dict[str, str] | None = None,
    ) -> None:
        nonlocal failures
        signature: dict[str, str] = {}
        attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                signature[name] = "constexpr"
                continue
            if name.endswith("_ptr"):
                signature[name] = (ptrs or {}).get(name, index_ptrs.get(name, f"*{dtype}"))
            else:
                signature[name] = "fp32" if name in floats else "i32"
            if name.endswith("_ptr") or name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        started = time.perf_counter()
        try:
            kernel = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                target=target,
                options={"num_warps": warps, "num_stages": stages},
            )
        except Exception as exc:
            failures += 1
            rows.append({"kernel": label, "error": f"{type(exc).__name__}: {exc}"})
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            return
        ttgir = kernel.asm["ttgir"]
        row = {
            "kernel": label,
            "seconds": round(time.perf_counter() - started, 1),
            "shared_bytes": kernel.metadata.shared,
            "async_copies": ttgir.count("async_copy_global_to_local"),
            "wgmma": "warp_group_dot" in ttgir,
            "cubin_bytes": len(kernel.asm["cubin"]),
        }
        rows.append(row)
        print(f"ok   {label:<34} {json.dumps({k: v for k, v in row.items() if k != 'kernel'})}")

    attn = {
        "HEAD_DIM": 128,
        "BLOCK_D": 128,
        "BLOCK_SIZE": 16,
        "DOT_FP32": False,
        "INPUT_PRECISION": "tf32",
        "KV_FP8": False,
    }
    fp8_cache = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    for group in (1, 4, 8):
        build(
            f"decode_split bf16 group{group}",
            dec._decode_split_kernel,
            {**attn, "GROUP": group, "BLOCK_G": max(16, group), "BLOCK_N": 64},
            "bf16",
            4,
            2,
        )
    build(
        "decode_split fp32 group4",
        dec._decode_split_kernel,
        {**attn, "GROUP": 4, "BLOCK_G": 16, "BLOCK_N": 64, "DOT_FP32": True, "INPUT_PRECISION": "ieee"},
        "fp32",
        4,
        2,
    )
    for splits in (1, 32):
        build(
            f"decode_reduce bf16 splits{splits}",
            dec._decode_reduce_kernel,
            {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": splits},
            "bf16",
            4,
            1,
        )
    build(
        "prefill bf16 d128 group4",
        pre._prefill_kernel,
        {**attn, "GROUP": 4, "BLOCK_M": 128, "BLOCK_N": 64},
        "bf16",
        8,
        3,
    )
    build(
        "prefill bf16 d64 group1",
        pre._prefill_kernel,
        {**attn, "HEAD_DIM": 64, "BLOCK_D": 64, "GROUP": 1, "BLOCK_M": 128, "BLOCK_N": 64},
        "bf16",
        4,
        3,
    )
    build(
        "decode_split bf16 group4 fp8-kv",
        dec._decode_split_kernel,
        {**attn, "GROUP": 4, "BLOCK_G": 16, "BLOCK_N": 64, "KV_FP8": True},
        "bf16",
        4,
        2,
        fp8_cache,
    )
    build(
        "prefill bf16 d128 group4 fp8-kv",
        pre._prefill_kernel,
        {**attn, "GROUP": 4, "BLOCK_M": 128, "BLOCK_N": 64, "KV_FP8": True},
        "bf16",
        8,
        3,
        fp8_cache,
    )
    for kv_fp8 in (False, True):
        build(
            f"kv_cache_write bf16 fp8-kv={kv_fp8}",
            kv_cache_write._kv_cache_write_kernel,
            {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_HD": 1024, "KV_FP8": kv_fp8, "EXACT_FP8_ROUNDING": False},
            "bf16",
            4,
            1,
            fp8_cache if kv_fp8 else None,
        )
    for residual in (False, True):
        build(
            f"rms_norm bf16 residual={residual}",
            rmsnorm._rms_norm_kernel,
            {"HAS_RESIDUAL": residual, "BLOCK": 4096},
            "bf16",
            8,
            1,
        )
    build(
        "rotary bf16",
        rotary._rotary_kernel,
        {"NUM_Q_HEADS": 32, "NUM_K_HEADS": 8, "HALF": 64, "BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_HALF": 64},
        "bf16",
        4,
        1,
    )
    build("silu_and_mul bf16", activation._silu_and_mul_kernel, {"BLOCK": 1024}, "bf16", 4, 1)
    _compile_gemms(build)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_kernels_compile.json"
    path.write_text(json.dumps({"target": "cuda sm_90", "triton": triton.__version__, "kernels": rows}, indent=2))
    print(f"wrote {path}; {failures} failure(s)")
    return 1 if failures else 0


def main() -> int:
    args = _parse()
    if args.compile_only:
        return _compile_only(Path(args.out))
    import torch

    if not torch.cuda.is_available():
        if not args.smoke:
            print("no CUDA device: run with --smoke for the CPU interpreter check", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    bench = Bench(shapes=SMOKE if args.smoke else FULL, smoke=args.smoke, device=device)
    started = time.perf_counter()
    bench.guarded("correctness", "mixed_step", bench.mixed_step_vs_torch_backend)
    bench.decode(sweep=args.sweep)
    bench.prefill(sweep=args.sweep)
    bench.elementwise()
    bench.gemm(sweep=args.sweep)
    bench.launch_overhead()
    _print_tables(bench.records)
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu (TRITON_INTERPRET=1, {platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": args.smoke,
        "hbm_GBps_reference": HBM_GBPS,
        "peak_TFLOPs_reference": PEAK_TFLOPS,
        "decode_target_frac_hbm": DECODE_TARGET,
        "seconds": time.perf_counter() - started,
        "failures": bench.failures,
        **bench.records,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_kernels.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['seconds']:.1f} s)")
    if bench.failures:
        print(f"{len(bench.failures)} failure(s):", *bench.failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
