"""The MoE form of the sm_100a W4A4 grouped GEMM: one persistent launch per GEMM over every expert's tiles.

Rows of A are the (token, k) pairs sorted by expert, already quantized to NVFP4, each expert's run starting
on a 128-row boundary of one padded matrix (the 128x4 scale layout cannot be entered mid-block, and a
128-row segment of it is itself a valid swizzled scale matrix).  B is the experts' stacked weights.  The
kernel is the list form's (``grouped_w4a4_sm100``): group g = expert g, whose pointers (A + padded offset,
B + expert stride, ...) and sizes (pair count, N, K) an earlier device step writes (``moe_host``), so the
launch never waits for the host; experts with no pairs have no tiles.  Only the epilogue differs:

  gate_up (GEMM1)  w13's rows are interleaved at pack time in blocks of GATE_UP_BLOCK (gate rows
                   32q..32q+31, then up rows 32q..32q+31), the width of one epilogue subtile, so the gate
                   and up accumulators of the same output columns sit in the same CTA, in adjacent TMEM
                   column blocks.  Writes SiLU(alpha_gate * gate) * (alpha_up * up) to out[row, I].
  down (GEMM2)     writes alpha_e * topk_weight * acc to row ``pair`` (t * top_k + k) of a [T * top_k, H]
                   buffer, the row format of the Hopper path's fixed-order combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .grouped_w4a4_sm100 import GroupedW4A4Variant, dump_ptx
from .tiles import GATE_UP_BLOCK

__all__ = ["GATE_UP_BLOCK", "MoeGateUpVariant", "MoeDownVariant", "MOE_VARIANTS"]


@dataclass(frozen=True)
class MoeGateUpVariant(GroupedW4A4Variant):
    """GEMM1: N = 2 * I_pad interleaved gate/up rows, output [rows, I_pad] in the activation dtype."""

    out_dtype: torch.dtype = torch.bfloat16
    alpha_columns: ClassVar[int] = 2  # gate, up
    prefix: ClassVar[str] = "moe_gate_up_w4a4_sm100"

    def build_kernel(self) -> Any:
        from ._moe_w4a4_sm100_kernel import MoeGateUpSm100

        return MoeGateUpSm100(self)


@dataclass(frozen=True)
class MoeDownVariant(GroupedW4A4Variant):
    """GEMM2: output rows indexed by (token, k) pair, float32 (the combine's precision) or bfloat16."""

    out_dtype: torch.dtype = torch.float32
    out_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    pointer_columns: ClassVar[int] = 7  # A, B, A scales, B scales, out (all pairs), row -> pair, row -> weight
    prefix: ClassVar[str] = "moe_down_w4a4_sm100"

    def build_kernel(self) -> Any:
        from ._moe_w4a4_sm100_kernel import MoeDownSm100

        return MoeDownSm100(self)


MOE_VARIANTS = (
    *(MoeGateUpVariant(n, dtype) for n in (128, 256) for dtype in MoeGateUpVariant.out_dtypes),
    *(MoeDownVariant(n, torch.float32) for n in (128, 256)),
)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(dump_ptx(sys.argv[1], MOE_VARIANTS)))
