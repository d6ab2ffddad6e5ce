"""GPU tier for the threaded warm-up (moe_nvfp4.warmup; run with ``pytest -m gpu`` on the GPU machine): after
``compile_kernels`` in threads, no token count up to max_tokens compiles anything, and the outputs are right.

Tolerance (REL_TOL), ||out - ref|| / ||ref|| against the float64 reference on the same NVFP4 weights (bf16
rounding of x, the intermediate and the output).
"""

from __future__ import annotations

import secrets

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.sm90.host import compiled_variants
from moe_nvfp4.sm90 import gemm_gluon as moe_sm90_ws
from moe_nvfp4.sm90.gemm_fp8_ws import _fp8_ws_kernel
from moe_nvfp4.sm90.w4a8 import _gather_rows_kernel, _quantize_rows_kernel, fp8_first_tokens
from moe_nvfp4.warmup import compile_kernels

pytestmark = pytest.mark.gpu

REL_TOL = 1e-2


def _variants() -> int:
    """Triton's compiled variants of the MoE's kernels in this process, the Gluon GEMMs' and the W4A8 mode's
    included."""
    kernels = (moe_sm90_ws._moe_gemm_ws_kernel, _fp8_ws_kernel, _quantize_rows_kernel, _gather_rows_kernel)
    caches = (getattr(k, "device_caches", {}) for k in kernels)
    return compiled_variants() + sum(len(c[0]) for cache in caches for c in cache.values())


@pytest.mark.parametrize("threads", [8, 3])
def test_threaded_warmup_leaves_nothing_to_compile(threads: int) -> None:
    """After the threaded warm-up, the serial one (api.warmup_fused_moe: the same token counts) and every token
    count up to max_tokens compile nothing; the outputs match the reference."""
    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts, top_k, hidden, inter, max_tokens = 24, 3, 128 * threads, 128, 700
    q13 = m.quantize_nvfp4(
        torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5, segments=2
    )
    q2 = m.quantize_nvfp4(torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5)
    w = m.prepare_moe_weights(q13, q2)
    counts = compile_kernels(w, top_k, torch.bfloat16, max_tokens, forward=m.fused_moe, threads=threads)
    before = _variants()
    assert m.warmup_fused_moe(w, top_k, torch.bfloat16, max_tokens) == counts and _variants() == before
    for t in sorted({1, 2, 5, 16, 42, 43, 100, 257, 341, 342, 699, 700, *counts}):
        x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
        tw, ti = m.topk_softmax(torch.randn(t, experts, generator=gen, device="cuda"), top_k)
        out = m.fused_moe(x, w, tw, ti)
        assert _variants() == before, f"T={t} compiled a new kernel variant after the threaded warm-up"
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert ((out.double() - ref).norm() / ref.norm()).item() < REL_TOL, t


@pytest.mark.parametrize("eager_bound", ["shipped", "zero"])
def test_warmup_with_the_w4a8_copy_leaves_nothing_to_compile(monkeypatch, eager_bound: str) -> None:
    """With the W4A8 mode's e4m3 copy (the plugin's MOE_NVFP4_FP8_ACTIVATIONS=1) the warm-up compiles its kernels
    too, whatever eager forwards later choose (this small layer is under w4a8.FP8_MIN_EAGER_FLOPS: W4A16 eagerly as
    shipped; with the bound at zero, W4A8 from the rows bound, as a CUDA-graph capture chooses): no token count on
    either side of where the mode starts, T a multiple of 16 or not, compiles anything after it (the row quantizer
    once compiled again for T % 16 != 0 mid-serving).  The outputs stay within the mode's bound against the float64
    W4A16 reference (< 8e-2, tests/gpu/test_w4a8_gpu.py's REF_TOL)."""
    from moe_nvfp4.sm90 import w4a8

    if eager_bound == "zero":
        monkeypatch.setattr(w4a8, "FP8_MIN_EAGER_FLOPS", 0.0)
    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts, top_k, hidden, inter, max_tokens = 16, 4, 512, 384, 2048
    q13 = m.quantize_nvfp4(
        torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5, segments=2
    )
    q2 = m.quantize_nvfp4(torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5)
    w = m.prepare_moe_weights(q13, q2)
    fp8 = m.prepare_fp8_weights(w)
    first = fp8_first_tokens(top_k, experts)  # 320
    counts = m.warmup_fused_moe(w, top_k, torch.bfloat16, max_tokens, fp8_weights=fp8)
    assert first in counts
    before = _variants()
    graph = torch.cuda.CUDAGraph()  # a capture at the first count runs W4A8 either way: compiled by the warm-up
    x = torch.randn(first, hidden, generator=gen, device="cuda").bfloat16()
    tw, ti = m.topk_softmax(torch.randn(first, experts, generator=gen, device="cuda"), top_k)
    with torch.cuda.graph(graph):
        m.fused_moe(x, w, tw, ti, fp8_weights=fp8)
    assert _variants() == before, "a CUDA-graph capture of the W4A8 forward compiled a new kernel variant"
    for t in sorted({1, 37, first - 1, first, first + 1, 333, 1000, 1024, 2047, 2048}):
        x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
        tw, ti = m.topk_softmax(torch.randn(t, experts, generator=gen, device="cuda"), top_k)
        out = m.fused_moe(x, w, tw, ti, fp8_weights=fp8)
        assert _variants() == before, f"T={t} compiled a new kernel variant after the warm-up"
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 8e-2, t
