"""The batched activation format (vLLM's [local experts, max tokens, H] with per-expert counts): the torch twin
against the standard forward, the plan against its definition, the Triton kernels under the interpreter against the
twin, and bad input.

| what                                             | bound                                                  |
|--------------------------------------------------|--------------------------------------------------------|
| twin vs fused_moe_torch, one expert's rows       | exact (the same float32 math on the same rows)          |
| API on CPU (the twin) vs the twin                 | exact                                                  |
| routing plan: route_batched vs plan_batched_routing | bit-exact (integers)                                  |
| interpreter kernels (fp16) vs float64 twin        | ||out - ref|| / ||ref|| < 2e-3 per expert (fp16 x, act) |
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.expert_activation import RELU2, SWIGLU_OAI

INTERPRETER_TOL = 2e-3


def _weights(gen: torch.Generator, e: int, h: int, i: int, activation=m.SILU, bias: bool = False):
    rows = 2 * i if activation.gated else i
    q13 = m.quantize_nvfp4(torch.randn(e, rows, h, generator=gen) / h**0.5, segments=2 if activation.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen) / i**0.5)
    b13 = torch.randn(e, rows, generator=gen) if bias else None
    b2 = torch.randn(e, h, generator=gen) if bias else None
    w = m.prepare_moe_weights(q13, q2, activation=activation, w13_bias=b13, w2_bias=b2)
    return q13, q2, b13, b2, w


@pytest.mark.parametrize(
    "activation,bias", [(m.SILU, False), (SWIGLU_OAI, True), (RELU2, False)], ids=["silu", "swiglu_oai+bias", "relu2"]
)
def test_twin_is_the_standard_forward_per_expert(gen: torch.Generator, activation, bias: bool) -> None:
    """Each counted row of expert e is fused_moe_torch of that token routed to e alone with weight 1."""
    e, h, i, max_tokens = 3, 64, 32, 6
    q13, q2, b13, b2, _ = _weights(gen, e, h, i, activation, bias)
    x = torch.randn(e, max_tokens, h, generator=gen).bfloat16()
    counts = torch.tensor([4, 0, max_tokens], dtype=torch.int32)
    out = m.fused_moe_batched_torch(x, q13, q2, counts, activation=activation, w13_bias=b13, w2_bias=b2)
    for expert, count in enumerate(counts.tolist()):
        ids = torch.full((count, 1), expert, dtype=torch.int32)
        want = m.fused_moe_torch(
            x[expert, :count], q13, q2, torch.ones(count, 1), ids, activation=activation, w13_bias=b13, w2_bias=b2
        )
        assert torch.equal(out[expert, :count], want)
        assert not out[expert, count:].any(), "rows past the count are 0 in the twin"


def test_api_on_cpu_runs_the_twin_and_ignores_padding(gen: torch.Generator) -> None:
    """Garbage (NaN) in the rows past each count changes nothing; counts past max_tokens or negative are clamped."""
    e, h, i, max_tokens = 4, 64, 32, 5
    q13, q2, _, _, w = _weights(gen, e, h, i)
    x = torch.randn(e, max_tokens, h, generator=gen).half()
    counts = torch.tensor([2, -7, 99, 0], dtype=torch.int64)
    clamped = counts.clamp(0, max_tokens)
    poisoned = x.clone()
    for expert, count in enumerate(clamped.tolist()):
        poisoned[expert, count:] = float("nan")
    out = torch.full_like(x, float("nan"))
    got = m.fused_moe_batched(poisoned, w, counts, out=out)
    assert got is out
    want = m.fused_moe_batched_torch(x, q13, q2, clamped)
    for expert, count in enumerate(clamped.tolist()):
        assert torch.equal(out[expert, :count], want[expert, :count])


@pytest.mark.parametrize(
    "counts,max_tokens,block_m",
    [
        pytest.param([3, 0, 8, 1], 8, 4, id="ragged, an empty expert, a full one"),
        pytest.param([5, 5], 5, 16, id="max_tokens not a multiple of the tile"),
        pytest.param([0, 0, 0], 7, 8, id="every expert empty"),
        pytest.param([-2, 40, 3], 9, 2, id="corrupt counts clamped"),
        pytest.param([1], 0, 8, id="no rows at all"),
    ],
)
def test_plan_matches_its_definition(counts: list[int], max_tokens: int, block_m: int) -> None:
    plan = m.plan_batched_routing(torch.tensor(counts, dtype=torch.int32), max_tokens, block_m)
    clamped = [min(max(c, 0), max_tokens) for c in counts]
    tiles = [
        (e, e * max_tokens + r, e * max_tokens + min(r + block_m, c))
        for e, c in enumerate(clamped)
        for r in range(0, c, block_m)
    ]
    n_max = len(counts) * -(-max_tokens // block_m)
    assert plan.top_k == 1 and plan.sorted_pairs.tolist() == list(range(len(counts) * max_tokens))
    assert plan.expert_counts.tolist() == clamped
    assert plan.expert_offsets.tolist() == [e * max_tokens for e in range(len(counts) + 1)]
    assert plan.num_tiles.tolist() == [len(tiles)]
    assert plan.tile_expert.tolist() == [t[0] for t in tiles] + [-1] * (n_max - len(tiles))
    assert plan.tile_row_start.tolist() == [t[1] for t in tiles] + [0] * (n_max - len(tiles))
    assert plan.tile_row_end.tolist() == [t[2] for t in tiles] + [0] * (n_max - len(tiles))


def _bad_calls(w, x, counts):
    return [
        (lambda: m.fused_moe_batched(x.float(), w, counts), TypeError, "x must be a bfloat16 or float16"),
        (lambda: m.fused_moe_batched(x[0], w, counts), ValueError, "x must be \\[E=3, max_tokens, H=64\\]"),
        (lambda: m.fused_moe_batched(x[:2], w, counts[:2]), ValueError, "x must be \\[E=3"),
        (lambda: m.fused_moe_batched(x, w, counts.float()), TypeError, "expert_num_tokens must be an int32 or int64"),
        (lambda: m.fused_moe_batched(x, w, [1, 2, 3]), TypeError, "expert_num_tokens must be an int32 or int64"),
        (lambda: m.fused_moe_batched(x, w, counts[:2]), ValueError, "expert_num_tokens must be \\[E=3\\]"),
        (lambda: m.fused_moe_batched(x, w, counts[None]), ValueError, "expert_num_tokens must be \\[E=3\\]"),
        (lambda: m.fused_moe_batched(x, w, counts, expected_rows=0), ValueError, "expected_rows must be a positive"),
        (lambda: m.fused_moe_batched(x, w, counts, out=torch.empty_like(x).float()), ValueError, "out must be a"),
        (lambda: m.fused_moe_batched(x, w, counts, out=torch.empty_like(x)[:, :1]), ValueError, "out must be a"),
        (
            lambda: m.fused_moe_batched(
                x, w, counts, out=torch.empty_like(x).transpose(0, 1).contiguous().transpose(0, 1)
            ),
            ValueError,
            "out must be contiguous",
        ),
    ]


def test_bad_input_names_the_argument(gen: torch.Generator) -> None:
    _, _, _, _, w = _weights(gen, 3, 64, 32)
    x = torch.randn(3, 4, 64, generator=gen).bfloat16()
    counts = torch.tensor([1, 2, 3], dtype=torch.int32)
    for call, error, message in _bad_calls(w, x, counts):
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(ValueError, match="expert_num_tokens must be \\[E"):
        m.plan_batched_routing(torch.zeros(0, dtype=torch.int32), 4, 8)


def test_strided_x_is_read_as_its_values(gen: torch.Generator) -> None:
    """A view of x (every other hidden column of a wider buffer) is copied, not misread."""
    q13, q2, _, _, w = _weights(gen, 2, 64, 32)
    wide = torch.randn(2, 3, 128, generator=gen).bfloat16()
    counts = torch.tensor([3, 1], dtype=torch.int32)
    out = m.fused_moe_batched(wide[:, :, ::2], w, counts)
    want = m.fused_moe_batched_torch(wide[:, :, ::2].contiguous(), q13, q2, counts)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1, :1], want[1, :1])


# The kernels under the Triton interpreter: a subprocess, so TRITON_INTERPRET is set before triton is imported.
SCRIPT = textwrap.dedent(
    """
    import sys, torch, moe_nvfp4 as m
    from moe_nvfp4.expert_activation import RELU2, SWIGLU_OAI
    from moe_nvfp4.sm90.host import batched_config, fused_moe_batched_sm90
    from moe_nvfp4.triton.routing_kernels import route_batched
    e, h, i, max_tokens, seed, variant, expected = map(int, sys.argv[1:8])
    counts = torch.tensor([int(c) for c in sys.argv[8].split(",")], dtype=torch.int32)
    act = (m.SILU, SWIGLU_OAI, RELU2)[variant]
    g = torch.Generator().manual_seed(seed)
    rows = 2 * i if act.gated else i
    q13 = m.quantize_nvfp4(torch.randn(e, rows, h, generator=g) / h**0.5, segments=2 if act.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=g) / i**0.5)
    b13, b2 = (torch.randn(e, rows, generator=g), torch.randn(e, h, generator=g)) if variant == 1 else (None, None)
    w = m.prepare_moe_weights(q13, q2, activation=act, w13_bias=b13, w2_bias=b2)
    x = torch.randn(e, max_tokens, h, generator=g).half()
    clamped = counts.clamp(0, max_tokens)
    for expert, count in enumerate(clamped.tolist()):
        x[expert, count:] = float("nan")  # padding rows: garbage that must reach no counted row
    config = batched_config(e, h, i, torch.float16, act.gated, float(expected), x.device)
    plan = m.plan_batched_routing(counts, max_tokens, config.block_m)
    got = route_batched(counts, max_tokens, config.block_m)
    for a, b in zip(got, (plan.sorted_pairs, plan.expert_counts, plan.expert_offsets, plan.tile_expert,
                          plan.tile_row_start, plan.tile_row_end, plan.num_tiles)):
        assert torch.equal(a, b), (a, b)
    out = torch.full_like(x, float("nan"))
    fused_moe_batched_sm90(x, w, counts, out, config)
    ref = m.fused_moe_batched_torch(torch.nan_to_num(x), q13, q2, counts, activation=act, w13_bias=b13,
                                    w2_bias=b2, compute_dtype=torch.float64)
    worst = 0.0
    for expert, count in enumerate(clamped.tolist()):
        assert out[expert, count:].isnan().all(), "a row past the count was written"
        if count:
            got_rows, want = out[expert, :count].double(), ref[expert, :count]
            worst = max(worst, ((got_rows - want).norm() / want.norm()).item())
    print(config.block_m, worst)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "e,h,i,max_tokens,variant,expected,counts,block_m",
    [
        pytest.param(3, 128, 64, 7, 0, 1, "2,0,7", 8, id="8-row tiles, empty expert, a full one (M=7)"),
        pytest.param(4, 128, 64, 20, 0, 8, "20,3,0,17", 16, id="16-row tiles (narrow MMAs), M=20 not a multiple"),
        pytest.param(2, 128, 64, 130, 0, 100, "130,1", 128, id="128-row tiles (Triton prefill GEMMs), M=130"),
        pytest.param(2, 144, 48, 5, 1, 1, "5,-4", 8, id="swiglu_oai + biases, padded K, a negative count"),
        pytest.param(3, 128, 64, 6, 2, 1, "1,99,0", 8, id="relu2, a count past max_tokens"),
    ],
)
def test_kernels_match_twin_under_interpreter(e, h, i, max_tokens, variant, expected, counts, block_m, seed) -> None:
    args = [e, h, i, max_tokens, seed % 2**31, variant, expected, counts]
    env = dict(os.environ, TRITON_INTERPRET="1", MOE_NVFP4_BACKEND="triton")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tile, err = proc.stdout.split()[-2:]
    assert int(tile) == block_m, "the config this case was written for"
    assert float(err) < INTERPRETER_TOL
