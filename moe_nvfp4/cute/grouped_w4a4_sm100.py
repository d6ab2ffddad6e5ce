"""W4A4 NVFP4 grouped GEMM for Blackwell (sm_100a) in CuTe DSL: per group g, out_g = alpha_g * A_g @ B_g^T.

The operands of ``triton/grouped_w4a4.py`` (packed e2m1, K-major; e4m3 scales per 16 K-elements in the 128x4
blocked layout) go to the tensor core as they are: ``tcgen05.mma.kind::mxf4nvf4.block_scale.block16`` reads
FP4 A and B from shared memory and their scales from tensor memory, and accumulates in fp32 in tensor memory.

One persistent launch of ``num_ctas`` CTAs (the SM count, not a function of the data) walks every group's
tiles: tile t of the concatenation goes to CTA t mod num_ctas, and each warp role finds the group of its
tile by walking the per-group sizes on the device (``sizes`` may be written by an earlier kernel).  Six
warps per CTA:
  warp 5     TMA producer: A, B, SFA, SFB of one 256-wide K stage per ring slot.  Each CTA owns four TMA
             descriptors in a global workspace and rewrites address, sizes and strides in place
             (``tensormap.replace``) whenever its next tile belongs to another group.
  warp 4     MMA: copies the stage's scales smem -> TMEM (``tcgen05.cp``), issues 4 MMAs of K = 64.
  warps 0-3  epilogue: TMEM -> registers (``tcgen05.ld``), times alpha_g, fp16/bf16 stores with the
             ragged edges masked (rows past M_g, columns past N_g).
Accumulators are double-buffered in TMEM for 128 x 128 tiles (the epilogue of tile i overlaps the MMAs of
tile i + 1); a 128 x 256 accumulator takes 256 of the 512 columns next to the scales, so it has one buffer.

The host side (pointer arrays, sizes, descriptor workspace) is in ``host.py``; cutlass is imported only
when a kernel is built, so ``import moe_nvfp4`` never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import torch

from .tiles import _OUT_DTYPES, SF_VEC, TILE_K, TILE_M

__all__ = [
    "GroupedW4A4Variant",
    "VARIANTS",
    "dump_ptx",
    "TILE_M",
    "TILE_K",
    "SF_VEC",
    "kernel_arguments",
    "compile_variant",
    "compiled_kernel",
]


@dataclass(frozen=True)
class GroupedW4A4Variant:
    """One compiled kernel: the MMA tile's N and the output dtype.  Subclasses (the MoE forms) change the
    epilogue, and with it the per-group pointer and alpha columns the kernel reads."""

    tile_n: int = 128
    out_dtype: torch.dtype = torch.float16
    out_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    pointer_columns: ClassVar[int] = 5  # per group: A, B, A scales, B scales, out
    alpha_columns: ClassVar[int] = 1
    prefix: ClassVar[str] = "grouped_w4a4_sm100"

    def __post_init__(self) -> None:
        if self.tile_n not in (128, 256):
            raise ValueError(f"tile_n must be 128 or 256, got {self.tile_n}")
        if self.out_dtype not in self.out_dtypes:
            raise TypeError(f"out_dtype must be one of {self.out_dtypes}, got {self.out_dtype}")

    @property
    def acc_stages(self) -> int:
        """TMEM accumulator buffers: two 128 x 128 fp32 tiles, or one 128 x 256 (+ scales) in 512 columns."""
        return 2 if self.tile_n == 128 else 1

    @property
    def name(self) -> str:
        return f"{self.prefix}_128x{self.tile_n}x{TILE_K}_{_OUT_DTYPES[self.out_dtype].lower()}"

    def build_kernel(self) -> Any:
        """The kernel object of this variant (imports cutlass)."""
        from ._grouped_w4a4_sm100_kernel import GroupedW4A4Sm100

        return GroupedW4A4Sm100(self)


def kernel_arguments(
    addresses: tuple[int, ...], template_mnk: tuple[int, int, int], num_groups: int, num_ctas: int, stream: int
) -> tuple:
    """The launch's arguments in the order of ``GroupedW4A4Sm100.__call__``.  ``addresses``: template A, B,
    SFA, SFB (the descriptors' static part comes from these), then the device arrays pointers int64
    [G, pointer_columns], sizes int32 [G, 3], alpha float32 [G, alpha_columns] and the descriptor workspace [num_ctas, 4, 128 B]."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    kinds = (
        (cutlass.Float4E2M1FN, 16),
        (cutlass.Float4E2M1FN, 16),
        (cutlass.Float8E4M3FN, 16),
        (cutlass.Float8E4M3FN, 16),
        (cutlass.Int64, 16),
        (cutlass.Int32, 16),
        (cutlass.Float32, 16),
        (cutlass.Int64, 128),
    )
    pointers = [
        make_ptr(dtype, address, AddressSpace.gmem, assumed_align=align)
        for (dtype, align), address in zip(kinds, addresses)
    ]
    m, n, k = (cutlass.Int32(v) for v in template_mnk)
    return (
        *pointers[:4],
        m,
        n,
        k,
        *pointers[4:],
        cutlass.Int32(num_groups),
        cutlass.Int32(num_ctas),
        cuda.CUstream(stream),
    )


def compile_variant(variant: GroupedW4A4Variant, options: str = "") -> Any:
    """``cute.compile`` one variant for sm_100a (no GPU needed); ``options`` e.g. ``--keep-ptx --dump-dir D``."""
    import cutlass.cute as cute

    # Address 0 and one group are placeholders with the launch's types: tracing dereferences nothing.
    arguments = kernel_arguments((0,) * 8, (TILE_M, variant.tile_n, TILE_K), 1, 1, 0)
    return cute.compile(variant.build_kernel(), *arguments, options=f"--gpu-arch sm_100a {options}".strip())


@cache
def compiled_kernel(variant: GroupedW4A4Variant) -> Any:
    """The compiled launcher of one variant, built once per process."""
    return compile_variant(variant)


VARIANTS = tuple(GroupedW4A4Variant(n, dtype) for n in (128, 256) for dtype in GroupedW4A4Variant.out_dtypes)


def dump_ptx(directory: str, variants: Sequence[GroupedW4A4Variant] = VARIANTS) -> dict[str, float]:
    """Compile every variant for sm_100a, keeping its PTX in ``directory/<variant name>/``; returns the
    seconds each compile took.  Needs ``CUTE_DSL_ARCH=sm_100a`` and no GPU."""
    import os
    import time

    seconds = {}
    for variant in variants:
        out = os.path.join(directory, variant.name)
        os.makedirs(out, exist_ok=True)  # the DSL writes no PTX into a folder that does not exist
        start = time.perf_counter()
        compile_variant(variant, f"--keep-ptx --dump-dir {out}")
        seconds[variant.name] = time.perf_counter() - start
    return seconds


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(dump_ptx(sys.argv[1])))
