"""Whether a kernel change leaves the default launches' machine code alone, on the CPU (Triton compiles for sm_90
without a GPU): the sm_90 GEMMs of two checkouts compiled with each one's tests/test_sm90_ptx.py helpers at the
default variant (gated SiLU, no bias, GEMM2 weighting each pair), over the Triton kernel's token tiles and narrow
widths and the Gluon kernel's shipped shapes (pair tiles, expert map, K groups, narrow tiles, loader warps).

    mkdir /tmp/old && git archive main moe_nvfp4 tests | tar -x -C /tmp/old
    python tools/codegen_ab.py /tmp/old .      # per launch: SASS (nvdisasm) and PTX without debug lines, same or not

Each checkout compiles in a process of its own (its own moe_nvfp4); exit status 1 if any launch differs.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

TRITON_TILES = ((16, 0), (64, 2), (32, 1), (128, 0), (8, 0))  # (block_m, narrow_tiles)
# (gated, block_n, warps, max_registers, chunks, k_groups, stages, block_m, narrow, loader_warps, pair_tiles, map)
GLUON_LAUNCHES = (
    [
        (g, 64, 4, 128, 2, 1, 2, 8, 0, 2, p, m)
        for g in (True, False)
        for p, m in ((False, False), (True, False), (True, True))
    ]
    + [(g, 64, 4, 168, 2, 2, 4, 8, 0, 2, p, False) for g in (True, False) for p in (False, True)]
    + [(g, 128, 4, 128, 1, 1, 4, 16, 1, 4, False, False) for g in (True, False)]
    + [(g, 128, 8, 168, 1, 1, 3, 64, 2, 4, False, False) for g in (True, False)]
    + [
        (True, 128, 8, 128, 2, 1, 4, 32, 2, 4, False, False),
        (False, 128, 4, 168, 1, 2, 2, 64, 0, 4, False, False),
        (True, 64, 4, 168, 1, 2, 2, 16, 0, 4, False, False),
        (True, 128, 4, None, 1, 1, 4, 16, 0, 4, False, False),
    ]
)


def _code(ptx: str) -> str:
    """PTX without what moves with source lines: .loc/.file, comments, debug labels and sections."""
    ptx = ptx[: ptx.find(".section")] if ".section" in ptx else ptx
    return "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", line))


def digests(root: Path) -> dict[str, list[str]]:
    """In this process: every launch's (SASS digest, PTX digest) for the checkout at ``root``."""
    sys.path[:0] = [str(root), str(root / "tests")]
    import moe_nvfp4
    import test_sm90_ptx as T

    assert Path(moe_nvfp4.__file__).resolve().is_relative_to(root.resolve()), moe_nvfp4.__file__
    gemm = T.KERNELS["gemm1"]
    first = "IS_GEMM1" if "IS_GEMM1" in gemm[2] else "GATED"  # the constexpr's name in trees before 2026-11-28
    gemm2 = dict(gemm[2], **{first: False})
    T.KERNELS["gemm2"] = (gemm[0], dict(T.GEMM_SIGNATURE, out_ptr="*fp32"), gemm2, 4)
    T.KERNELS["gemm2 x dtype"] = (gemm[0], T.GEMM_SIGNATURE, gemm2, 4)

    def digest(asm: dict) -> list[str]:
        return [hashlib.sha256(text.encode()).hexdigest()[:16] for text in (T._sass(asm["cubin"]), _code(asm["ptx"]))]

    out = {}
    for name in ("gemm1", "gemm2", "gemm2 x dtype"):
        for block_m, narrow in TRITON_TILES:
            for aligned in (False, True):
                asm = T._compile(name, True, block_m=block_m, narrow=narrow, aligned=aligned).asm
                out[f"triton {name} block_m {block_m} narrow {narrow} aligned {aligned}"] = digest(asm)
    for g, bn, w, reg, ch, kg, st, bm, nr, lw, p, m in GLUON_LAUNCHES:
        asm = T._compile_ws(g, bn, w, reg, ch, kg, st, block_m=bm, narrow=nr, loader_warps=lw, pair_tiles=p, has_map=m)
        out[
            f"gluon gated {g} block_n {bn} warps {w} maxnreg {reg} chunks {ch} k_groups {kg} stages {st} block_m {bm} "
            f"narrow {nr} loader_warps {lw} pair_tiles {p} map {m}"
        ] = digest(asm)
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--digests":
        json.dump(digests(Path(sys.argv[2])), sys.stdout)
        return 0
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    before, after = (
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--digests", root], check=True, capture_output=True, text=True
            ).stdout
        )
        for root in sys.argv[1:]
    )
    differ = [k for k in before if before[k] != after.get(k)]
    for k in before:
        print(f"{'same' if k not in differ else 'DIFFERS'}  {k}")
    print(f"{len(before) - len(differ)} of {len(before)} launches: same SASS and PTX")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
