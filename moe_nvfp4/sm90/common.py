"""What the sm_90 MoE GEMMs share, the Triton one (gemm_triton) and the Gluon one (gemm_gluon): the FP4 decode PTX
and its constants, the tile order, the epilogue variants and the activations, the named groups a GEMM launch takes
(GemmWeights, GemmRouting, Epilogue).  A module of its own so the kernel modules import it, not each other; what
every Triton kernel of the forward shares (the routing predicate, programmatic dependent launch, the dtype map) is
``triton.common``'s.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..expert_activation import ExpertActivation
from ..layouts import FragmentLayout

__all__ = [
    "BLOCK_BYTES",
    "SCALE_BLOCK_BYTES",
    "DECODE_BF16",
    "DECODE_FP16",
    "BF16_EPILOGUE_FIX",
    "FP16_EPILOGUE_FIX",
    "Epilogue",
    "FragmentView",
    "GemmRouting",
    "GemmWeights",
    "fragment_views",
]


class GemmWeights(NamedTuple):
    """One GEMM's expert weights in layouts.FragmentLayout, as a GEMM launch reads them (weights.MoEWeights' w13_*
    or w2_* tensors).  packed: uint8 [E, N rows, K/2]; scale: uint8 [E, N rows, K/16]; global_scale: float32 [E, 2]
    (GEMM1's gate and up) or [E]."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor


class FragmentView(NamedTuple):
    """A TMA view of FragmentLayout bytes (values or scales), whose (unit u, K chunk c) block sits at
    u * chunks_k + c: dims [chunk, unit, row, byte] (innermost last), each block ``rows`` rows of 128 bytes (a
    4 KiB value block, a 512-byte scale block).  A box of [c, u, rows, 128] holds u consecutive 64-row units by c
    chunks; rows of 128 bytes stream faster than 32-byte ones (design 002, decision 14)."""

    flat: torch.Tensor
    shape: list[int]
    strides: list[int]
    rows: int


def fragment_views(w_packed: torch.Tensor, w_scale: torch.Tensor, kp: int) -> tuple[FragmentView, FragmentView]:
    """The values' and the scales' TMA views of one GEMM's FragmentLayout weights (K padded to ``kp``), as the
    Gluon and the Triton GEMMs' descriptors take them."""
    fragments = FragmentLayout()  # host ints (BLOCK_BYTES and SCALE_BLOCK_BYTES are the kernels' constexprs)
    chunks_k = kp // fragments.chunk_k
    n_units = w_packed.numel() // (chunks_k * fragments.block_bytes)

    def view(t: torch.Tensor, block: int) -> FragmentView:
        rows = block // 128
        return FragmentView(t.reshape(-1), [chunks_k, n_units, rows, 128], [block, chunks_k * block, 128, 1], rows)

    return view(w_packed, fragments.block_bytes), view(w_scale, fragments.scale_block_bytes)


class GemmRouting(NamedTuple):
    """Where both GEMM launches of a forward find each token tile's expert and rows.  tile_map:
    routing_kernels.route()'s (sorted_pairs, tile_expert, tile_row, tile_row_end, num_tiles), as in
    routing.RoutingPlan, or with ``pair_tiles`` a stand-in that goes unread: each (token, k) pair of ``topk_ids``
    (flat [T * top_k], global expert ids; through ``expert_map`` where given) is then a tile of its own.  The
    router weights are not the GEMMs': the combine applies them (triton.combine)."""

    tile_map: tuple[torch.Tensor, ...]
    topk_ids: torch.Tensor
    expert_map: torch.Tensor | None
    pair_tiles: bool


class Epilogue(NamedTuple):
    """A GEMM's epilogue variant, one kernel argument (a tuple: constexprs but the bias pointer).  The kernels read
    it by position (EPILOGUE[i]; a tuple argument's field names do not reach the compiled kernel).

    bias: float32 [E, N] added to each row after the global scales (GEMM1: [E, 2I] gate then up, or [E, I]; GEMM2:
    [E, H]), or None.  ACTIVATION: GEMM1's expert_activation name ("silu", "swiglu_oai", "relu2"), None for GEMM2;
    ALPHA, LIMIT: swiglu_oai's.  GATE_UP: the weights hold gate rows then up rows (GEMM1 of a gated activation,
    ExpertActivation.gated), else one matrix of N rows.  GEMM2 never applies the router weights (its epilogue
    waited on their loads after the K loop); the combine weights each row (design 002 decision 9)."""

    bias: torch.Tensor | None
    ACTIVATION: tl.constexpr
    ALPHA: tl.constexpr
    LIMIT: tl.constexpr
    GATE_UP: tl.constexpr

    @classmethod
    def of(cls, bias: torch.Tensor | None, activation: ExpertActivation | None) -> "Epilogue":
        """The launch argument of GEMM1 (its ``activation``) or GEMM2 (None), each field but the bias a
        tl.constexpr: in a tuple argument a plain bool or float would be a run-time value (and a str no value)."""
        return cls(bias, *_epilogue_constexprs(activation))


@functools.cache
def _epilogue_constexprs(activation: ExpertActivation | None) -> tuple[tl.constexpr, ...]:
    """Epilogue's fields after the bias, built once per variant (two launches a forward ask)."""
    fields = (None, None, None) if activation is None else (activation.name, activation.alpha, activation.limit)
    gate_up = activation is not None and activation.gated
    return tuple(map(tl.constexpr, (*fields, gate_up)))


# Bytes of one 64-row unit and 128-wide K chunk in layouts.FragmentLayout: values, then (separately) scales
BLOCK_BYTES: tl.constexpr = tl.constexpr(FragmentLayout().block_bytes)
SCALE_BLOCK_BYTES: tl.constexpr = tl.constexpr(FragmentLayout().scale_block_bytes)

# FP4 -> 16-bit decode of two 32-bit words of layouts.FragmentLayout (eight values each, bits
# FRAGMENT_WORD_BITS) and their block scales: bytes 2 w and 2 w + 1 of $10 are word w's (rows R and R + 8),
# the four scale bytes of a word pair as loaded, so no instruction builds a per-word scale operand ($11
# repeats $10: inline asm takes as many scale bytes as value bytes).  Per word, four masked
# shifts/multiplies put each value pair into the exponent LSBs / first mantissa bit of a bf16x2 register
# (code * 2^-126), one packed multiply applies the scale.  fp16 moves the three magnitude bits up by three
# (code * 2^-14).  Outputs: $0..$3 rows R (word 0, then 1), $4..$7 rows R + 8.
_DECODE_WORD = """
prmt.b32 x, $10, 0, {select};
mad.lo.u32 s, x, {scale_mul}, {scale_add};
mov.b32 {{s0, s1}}, s;
mov.b32 lo, {{s0, s0}};
mov.b32 hi, {{s1, s1}};
and.b32 x, ${word}, 0x81C081C0;{fix}
mul.rn.{ty}x2 ${lo0}, x, lo;
shl.b32 x, ${word}, 3; and.b32 x, x, 0x81C081C0;{fix}
mul.rn.{ty}x2 ${lo1}, x, lo;
and.b32 x, ${word}, 0x40074007; mul.lo.u32 x, x, 66; and.b32 x, x, 0x81C081C0;{fix}
mul.rn.{ty}x2 ${hi0}, x, hi;
shr.b32 x, ${word}, 3; and.b32 x, x, 0x05C005C0; mul.lo.u32 x, x, 33; and.b32 x, x, 0x81C081C0;{fix}
mul.rn.{ty}x2 ${hi1}, x, hi;"""
_FP16_FIX = "\nshl.b32 t, x, 3; and.b32 t, t, 0x0E000E00; and.b32 x, x, 0x80008000; or.b32 x, x, t;"


def _decode_asm(scale_mul: int, scale_add: str, fix: str, ty: str) -> str:
    words = (
        _DECODE_WORD.format(
            select=select,
            word=8 + w,
            lo0=2 * w,
            lo1=2 * w + 1,
            hi0=4 + 2 * w,
            hi1=5 + 2 * w,
            scale_mul=scale_mul,
            scale_add=scale_add,
            fix=fix,
            ty=ty,
        )
        for w, select in enumerate(("0x4140", "0x4342"))
    )
    return "{\n.reg .b32 s, x, t, lo, hi;\n.reg .b16 s0, s1;" + "".join(words) + "\n}"


DECODE_BF16: tl.constexpr = tl.constexpr(_decode_asm(16, "0x70007000", "", "bf16"))
DECODE_FP16: tl.constexpr = tl.constexpr(_decode_asm(128, "0x14001400", _FP16_FIX, "f16"))
# The decoded scale is block_scale * 2^107 (bf16) or block_scale (fp16), the decoded code value * 2^-126 or
# value * 2^-14: every product is exact, and the epilogue multiplies by EPILOGUE_FIX.
BF16_EPILOGUE_FIX: tl.constexpr = tl.constexpr(2.0**19)
FP16_EPILOGUE_FIX: tl.constexpr = tl.constexpr(2.0**14)


@triton.jit
def _decode_words(p, s8, DTYPE: tl.constexpr):
    """The decode PTX on packed bytes: p eight FP4 bytes (two words) per call, s8 their four scale bytes
    (word 0 rows R, R + 8, word 1 the same) twice; returns the lo / hi rows' values.  Shared by the Triton and
    the Gluon (gemm_gluon) kernels."""
    constraints: tl.constexpr = "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r"
    if DTYPE == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(
            DECODE_BF16, constraints, [p, s8], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=8
        )
    else:
        lo, hi = tl.inline_asm_elementwise(
            DECODE_FP16, constraints, [p, s8], dtype=(tl.float16, tl.float16), is_pure=True, pack=8
        )
    return lo, hi


@triton.jit
def _silu_times(gate, up, USE_ASM: tl.constexpr):
    """The gated activation SiLU(gate) * up = gate / (1 + 2^(-gate log2 e)) * up, in fp32 (GEMM1's epilogue).
    On the GPU the reciprocal is rcp.approx (1 ulp; its argument is >= 1, so
    no subnormals): about 5 instructions a value against 12 for tl.exp and the `/` (div.full's range fix-ups), in
    an epilogue that is on a decode forward's critical path.  Large negative gates give 2^x = inf, r = 0, 0."""
    denom = 1.0 + tl.exp2(gate * -1.4426950408889634)
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [denom], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        r = 1.0 / denom
    return gate * r * up


@triton.jit
def _swiglu_oai(gate, up, ALPHA: tl.constexpr, LIMIT: tl.constexpr, USE_ASM: tl.constexpr):
    """gpt-oss's clamped SwiGLU (expert_activation): g = min(gate, LIMIT), (clamp(up, +-LIMIT) + 1) g sigmoid(ALPHA g),
    the sigmoid as in _silu_times.  The clamps keep NaN, as torch.clamp does (PTX min/max would return the other
    operand: a NaN token came out finite on an H200)."""
    gate = tl.minimum(gate, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    up = tl.clamp(up, -LIMIT, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    denom = 1.0 + tl.exp2(gate * (-1.4426950408889634 * ALPHA))
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [denom], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        r = 1.0 / denom
    return gate * r * (up + 1.0)


@triton.jit
def _activation(gate, up, EPILOGUE, USE_ASM: tl.constexpr):
    """GEMM1's activation on its float32 rows (bias added): EPILOGUE's ACTIVATION of gate and up, or of gate
    alone (relu2: relu(h)^2, NaN kept as torch.relu keeps it; ``up`` unused)."""
    ACTIVATION: tl.constexpr = EPILOGUE[1]
    if ACTIVATION == "relu2":
        h = tl.maximum(gate, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return h * h
    elif ACTIVATION == "swiglu_oai":
        return _swiglu_oai(gate, up, EPILOGUE[2], EPILOGUE[3], USE_ASM)
    else:
        return _silu_times(gate, up, USE_ASM)


@triton.jit
def _grouped_tile(mn, num_m_tiles, num_n_tiles):
    """Tile mn's (token tile, weight tile) in grouped order: GROUP token tiles share each weight tile while it is
    hot in L2.  Shared by the Triton and the Gluon (gemm_gluon) kernels.  Which program runs a tile never changes
    its sums (whole K per tile), so the order is a matter of speed only.  GROUP is 8, what every tuned config ran
    with while it was a GemmConfig field (until config version 3): the order their timings saw."""
    GROUP: tl.constexpr = 8
    group = mn // (GROUP * num_n_tiles)
    first_m = group * GROUP
    tiles_in_group = tl.minimum(num_m_tiles - first_m, GROUP)
    in_group = mn % (GROUP * num_n_tiles)
    return first_m + in_group % tiles_in_group, in_group // tiles_in_group
