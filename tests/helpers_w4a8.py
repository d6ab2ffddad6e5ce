"""The W4A8 mode's bound against its pure-torch twin, shared by the GPU tests that check its kernels
(tests/gpu/test_w4a8_gpu.py, whose docstring gives the basis, and tests/gpu/test_bounds_gpu.py).

sm_90's FP8 MMA sums a K step in about 13 bits before the kernel adds it into fp32, which moves an activation across
an e4m3 rounding boundary now and then: 6.3-7.3e-3 from the twin over 1024 tokens on an H200, up to 1.95e-2 over 5
(benchmarks/results/prefill_probes_2026-11-29/w4a8_twin_bound.md); one dropped or doubled pair moves a
few-token output 0.2 or more.
"""

from __future__ import annotations

TWIN_TOL = {"many tokens": 1e-2, "few tokens": 4e-2}


def token_count(tokens: int) -> str:
    """The bounds' key for a forward of ``tokens`` tokens: "many tokens" from 256 on, else "few tokens"."""
    return "many tokens" if tokens >= 256 else "few tokens"
