"""Property-based test of the public API (issue 54): random shapes, dtypes, strides, contiguity, poisoned values
(NaN, inf, out-of-range ids), corrupted metadata and devices.  Every call either raises a ValueError/TypeError
(CheckpointError is a ValueError) or returns what the torch reference returns; no other exception, no silent
difference.  Runs on CPU (the reference backends), on CUDA where present (the real kernels), and under the
Triton interpreter (TRITON_INTERPRET=1, a subprocess: the Triton kernels on CPU tensors, fp16 MoE only, since
the interpreter's bf16 tl.dot is wrong).

Examples per property: MOE_NVFP4_FUZZ_EXAMPLES (default 30: about a minute on 2 cores for the CPU and
interpreter tiers; set it to 300 for a long run, about 10 minutes).  The session seed (conftest) seeds hypothesis, so a failure replays with
MOE_NVFP4_TEST_SEED.

Tolerances, ||out - ref|| / ||ref|| over the finite rows, against the float64 reference on the same NVFP4 data:
  MOE_REL_TOL      fp16 2e-3, bf16 1e-2   roundings of x, the activation and the output (tests/gpu/test_fused_moe_gpu)
  GROUPED_REL_TOL  fp16 2e-3, bf16 8e-3   output rounding, float32 sums in another order (tests/test_grouped_w4a4;
                                          the interpreter truncates to bf16)
  quantize_activations: the twin's bytes exactly.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings, strategies as st

import moe_nvfp4 as m

EXAMPLES = int(os.environ.get("MOE_NVFP4_FUZZ_EXAMPLES", "30"))
MOE_REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
GROUPED_REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}
CLEAR_ERRORS = (ValueError, TypeError)
TESTS = Path(__file__).resolve().parent


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    norm = ref.norm().item()
    diff = (out.double() - ref).norm().item()
    return diff / norm if norm else diff


def _strided(t: torch.Tensor, how: str, gen: torch.Generator) -> torch.Tensor:
    """``t`` with the same values in another memory layout: contiguous, the leading columns of a wider buffer,
    every other row of a taller one, or column-major."""
    if how == "wider":
        buf = torch.zeros(t.shape[0], t.shape[1] + 3, dtype=t.dtype, device=t.device)
        buf[:, : t.shape[1]] = t
        return buf[:, : t.shape[1]]
    if how == "every other row":
        buf = torch.zeros(2 * t.shape[0], t.shape[1], dtype=t.dtype, device=t.device)
        buf[::2] = t
        return buf[::2]
    if how == "column-major":
        return t.t().contiguous().t()
    return t


LAYOUTS = st.sampled_from(["contiguous", "wider", "every other row", "column-major"])
# a mutation that must be refused with a clear error (None: a valid call)
MOE_MUTATIONS = st.sampled_from(
    [None] * 6
    + [
        "x float32",
        "x width",
        "ids float",
        "weights int",
        "ids rows",
        "map 2-D",
        "map short",
        "intermediate",
        "hidden",
        "k 17",
    ]
)


@st.composite
def moe_cases(draw, dtypes: tuple[torch.dtype, ...]) -> dict:
    e = draw(st.integers(1, 6))
    return dict(
        e=e,
        k=draw(st.integers(1, min(e, 4))),
        h=16 * draw(st.integers(1, 6)),
        i=16 * draw(st.integers(1, 5)),
        t=draw(st.integers(0, 9)),
        dtype=draw(st.sampled_from(dtypes)),
        weights_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        int64_ids=draw(st.booleans()),
        routing_layout=draw(LAYOUTS),
        x_layout=draw(LAYOUTS),
        use_map=draw(st.booleans()),
        poison_ids=draw(st.booleans()),
        nonfinite_tokens=draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf")]), max_size=2)),
        activation=draw(st.sampled_from([m.SILU, m.SWIGLU_OAI, m.RELU2])),
        biases=draw(st.booleans()),
        mutation=draw(MOE_MUTATIONS),
        new_size=16 * draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_fused_moe(c: dict, device: str) -> None:
    """fused_moe on a random case: a clear error for every mutation, else the reference's output (non-finite
    exactly on the tokens whose input is non-finite and that have a routed pair)."""
    gen = torch.Generator().manual_seed(c["seed"])
    e, k, h, i, t, act = c["e"], c["k"], c["h"], c["i"], c["t"], c["activation"]
    rows13 = 2 * i if act.gated else i
    q13 = m.quantize_nvfp4(torch.randn(e, rows13, h, generator=gen) / h**0.5, segments=2 if act.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen) / i**0.5)
    b13 = torch.randn(e, rows13, generator=gen) * 0.1 if c["biases"] else None
    b2 = torch.randn(e, h, generator=gen) * 0.1 if c["biases"] else None
    q13, q2 = q13.to(device), q2.to(device)
    weights = m.prepare_moe_weights(q13, q2, activation=act, w13_bias=b13, w2_bias=b2)
    n_global = e + 2 if c["use_map"] else e
    emap = None
    if c["use_map"]:  # two global experts on another rank
        emap = torch.tensor([-1] + list(range(e)) + [-1], dtype=torch.int32, device=device)
    tw, ti = m.topk_softmax(torch.randn(t, n_global, generator=gen), k, renormalize=True)
    if c["poison_ids"] and t:
        ti[0, 0] = -3
        ti[-1, -1] = n_global + 5
    ti = ti.long() if c["int64_ids"] else ti
    tw = tw.to(c["weights_dtype"])
    x = torch.randn(t, h, generator=gen)
    for token, value in enumerate(c["nonfinite_tokens"][:t]):
        x[token, token % h] = value
    x = x.to(c["dtype"])
    x_in = _strided(x.to(device), c["x_layout"], gen)
    tw_in, ti_in = (_strided(v.to(device), c["routing_layout"], gen) for v in (tw, ti))
    mutation, kwargs = c["mutation"], dict(expert_map=emap)
    if mutation == "x float32":
        x_in = x_in.float()
    elif mutation == "x width":
        x_in = torch.zeros(t, h + 16, dtype=c["dtype"], device=device)
    elif mutation == "ids float":
        ti_in = ti_in.float()
    elif mutation == "weights int":
        tw_in = tw_in.int()
    elif mutation == "ids rows":
        ti_in = ti_in[:0] if t else ti_in.new_zeros(1, k)
    elif mutation == "map 2-D":
        kwargs["expert_map"] = torch.zeros(2, n_global, dtype=torch.int32, device=device)
    elif mutation == "map short":
        kwargs["expert_map"] = (
            torch.zeros(e - 1, dtype=torch.int32, device=device)
            if e > 1
            else torch.zeros(0, dtype=torch.int32, device=device)
        )
    elif mutation == "k 17":
        tw_in, ti_in = tw_in.new_zeros(t, 17), ti_in.new_zeros(t, 17)
    elif mutation in ("intermediate", "hidden"):
        try:  # the same tensors with other sizes: refused unless the padded shapes are the same
            weights = dataclasses.replace(weights, **{mutation: c["new_size"]})
        except CLEAR_ERRORS:
            return
        if mutation == "hidden":
            x_in = torch.randn(t, c["new_size"], generator=gen).to(c["dtype"]).to(device)
        mutation = None  # accepted: the weights are the tensors' first rows / columns; the reference sees the same
    if mutation is not None:
        with pytest.raises(CLEAR_ERRORS):
            m.fused_moe(x_in, weights, tw_in, ti_in, **kwargs)
        return
    out = m.fused_moe(x_in, weights, tw_in, ti_in, **kwargs)
    r13, r2 = (q.to("cpu") for q in weights.to_nvfp4())
    ref = m.fused_moe_torch(
        x_in.cpu().contiguous(),
        r13,
        r2,
        tw.float(),
        ti,
        expert_map=None if emap is None else emap.cpu(),
        activation=act,
        w13_bias=weights.w13_bias.cpu() if c["biases"] else None,
        w2_bias=weights.w2_bias.cpu() if c["biases"] else None,
        compute_dtype=torch.float64,
    )
    out = out.cpu()
    assert out.shape == x_in.shape and out.dtype == c["dtype"]
    bad_in = ~torch.isfinite(x_in.cpu()).all(1)
    _, routed = m.routing.routed_pairs(ti, e, None if emap is None else emap.cpu())
    routed = routed.view(t, k).any(1)
    assert torch.equal(~torch.isfinite(out).all(1), bad_in & routed), "non-finite rows"
    assert torch.equal(~torch.isfinite(out).any(1) | ~(bad_in & routed), torch.ones(t, dtype=torch.bool)), (
        "a non-finite token's row is partly finite"
    )
    keep = ~(bad_in & routed)
    assert _rel(out[keep], ref[keep]) < MOE_REL_TOL[c["dtype"]]


@st.composite
def quant_cases(draw) -> dict:
    return dict(
        rows=draw(st.integers(0, 40)),
        k=draw(st.sampled_from([16, 32, 48, 80, 272, 8, 40])),  # 8 and 40: not multiples of 16
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        scale=draw(st.sampled_from([0.01, 2.0**-8, 1.0, 0.0, -0.5, float("nan"), float("inf"), 1e-30, 1e30])),
        scale_shape=draw(st.sampled_from([(1,), (), (2,)])),
        poison=draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf")]), max_size=3)),
        layout=draw(LAYOUTS),
        magnitude=draw(st.sampled_from([1e-6, 1.0, 1e3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_quantize_activations(c: dict, device: str) -> None:
    """The twin's bytes exactly (padding included); NaN exactly in the blocks holding NaN or inf, everywhere
    under an unusable scale."""
    gen = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(c["rows"], c["k"], generator=gen) * c["magnitude"]
    for n, value in enumerate(c["poison"]):
        if x.numel():
            x.view(-1)[(n * 7919) % x.numel()] = value
    x = x.to(c["dtype"])
    gs = torch.full(c["scale_shape"], c["scale"])
    x_in = _strided(x.to(device), c["layout"], gen)
    if c["k"] % 16 or c["scale_shape"] == (2,):
        with pytest.raises(CLEAR_ERRORS):
            m.quantize_activations(x_in, gs.to(device))
        return
    got = m.quantize_activations(x_in, gs.to(device))
    ref = m.quantize_activations_nvfp4(x, gs).swizzled_scales()
    assert torch.equal(got.packed.cpu(), ref.packed)
    assert torch.equal(got.block_scale.cpu().view(torch.uint8), ref.block_scale.view(torch.uint8))
    back = m.dequantize_nvfp4(got.to("cpu"))
    lo, hi = m.formats.INPUT_SCALE_RANGE
    usable = lo <= c["scale"] <= hi
    blocks_bad = ~torch.isfinite(x.float()).reshape(c["rows"], c["k"] // 16, 16).all(-1)
    want_nan = blocks_bad.repeat_interleave(16, 1) if usable else torch.ones_like(x, dtype=torch.bool)
    assert torch.equal(back.isnan(), want_nan)


@st.composite
def grouped_cases(draw) -> dict:
    groups = draw(st.integers(1, 3))
    return dict(
        sizes=[
            (draw(st.integers(0, 40)), draw(st.integers(1, 40)), 16 * draw(st.integers(1, 9))) for _ in range(groups)
        ],
        swizzled=draw(st.lists(st.booleans(), min_size=2 * groups, max_size=2 * groups)),
        alpha=draw(st.booleans()),
        out_dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
        mutation=draw(
            st.sampled_from(
                [None] * 4
                + ["scale rows", "scale NaN", "scale negative", "global 0", "global NaN", "K differs", "int8 packed"]
            )
        ),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_grouped_gemm(c: dict, device: str, launch_plan: bool) -> None:
    """grouped_gemm_nvfp4 (and, where a Triton kernel can run, a plan's launch): a clear error for every mutation,
    else the reference within GROUPED_REL_TOL."""
    gen = torch.Generator().manual_seed(c["seed"])
    a = [m.quantize_nvfp4(torch.randn(mm, k, generator=gen)) for mm, _, k in c["sizes"]]
    b = [m.quantize_nvfp4(torch.randn(n, k, generator=gen)) for _, n, k in c["sizes"]]
    ops = [t.swizzled_scales() if sw else t for t, sw in zip(a + b, c["swizzled"])]
    a, b = ops[: len(a)], ops[len(a) :]
    alpha = torch.rand(len(a), generator=gen) + 0.5 if c["alpha"] else None
    mutation, victim = c["mutation"], b[-1]
    linear = victim.linear_scales()
    if mutation == "scale rows":
        victim = m.NVFP4Tensor(linear.packed, linear.block_scale[: linear.n - 1], linear.global_scale)
    elif mutation in ("scale NaN", "scale negative"):
        bits = linear.block_scale.view(torch.uint8).clone()
        bits[-1, 0] = 0x7F if mutation == "scale NaN" else 0xB8
        victim = m.NVFP4Tensor(linear.packed, bits.view(m.NVFP4.scale_dtype), linear.global_scale)
    elif mutation in ("global 0", "global NaN"):
        victim = m.NVFP4Tensor(
            linear.packed, linear.block_scale, torch.tensor(0.0 if mutation == "global 0" else float("nan"))
        )
    elif mutation == "K differs":
        victim = m.quantize_nvfp4(torch.randn(linear.n, linear.k + 16, generator=gen))
    elif mutation == "int8 packed":
        victim = m.NVFP4Tensor(linear.packed.view(torch.int8), linear.block_scale, linear.global_scale)
    b = [*b[:-1], victim]
    a_dev, b_dev = [t.to(device) for t in a], [t.to(device) for t in b]
    alpha_dev = None if alpha is None else alpha.to(device)
    entries = [lambda: m.grouped_gemm_nvfp4(a_dev, b_dev, alpha=alpha_dev, out_dtype=c["out_dtype"])]
    if launch_plan:
        entries.append(
            lambda: m.launch_grouped_gemm_nvfp4(
                m.plan_grouped_gemm_nvfp4(a_dev, b_dev, alpha=alpha_dev, out_dtype=c["out_dtype"])
            )
        )
    if mutation is not None:
        for entry in entries:
            with pytest.raises(CLEAR_ERRORS):
                entry()
        return
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=torch.float32)
    for entry in entries:
        for out, want in zip(entry(), ref):
            assert out.shape == want.shape and out.dtype == c["out_dtype"]
            assert _rel(out.cpu(), want) < GROUPED_REL_TOL[c["out_dtype"]]


def _property(strategy, check, seed: int, examples: int):
    """``check`` over ``examples`` draws of ``strategy``, seeded: the failing case is printed with its blob."""
    run = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )(given(strategy)(check))
    return hypothesis_seed(seed)(run)


def run_all(seed: int, examples: int, device: str, interpreted: bool) -> None:
    """Every property on ``device``; ``interpreted``: the Triton kernels run on CPU tensors (fp16 MoE only)."""
    kernels = interpreted or device == "cuda"
    moe_dtypes = (torch.float16,) if interpreted else (torch.float16, torch.bfloat16)
    _property(moe_cases(moe_dtypes), lambda c: check_fused_moe(c, device), seed, examples)()
    _property(quant_cases(), lambda c: check_quantize_activations(c, device), seed + 1, 3 * examples)()
    _property(grouped_cases(), lambda c: check_grouped_gemm(c, device, launch_plan=kernels), seed + 2, examples)()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_public_api_properties(device: str, seed: int) -> None:
    """CPU: the reference backends (the checks and the paths around them); CUDA: the real kernels."""
    run_all(seed % 2**31, EXAMPLES, device, interpreted=False)


@pytest.mark.slow
def test_public_api_properties_under_the_triton_interpreter(seed: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", MOE_NVFP4_BACKEND="triton", PYTHONWARNINGS="ignore")
    script = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_fuzz_api as f; "
        f"f.run_all({seed % 2**31}, {EXAMPLES}, 'cpu', interpreted=True)"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
