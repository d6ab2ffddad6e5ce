"""benchmarks/tune_moe.py's candidate grid and its sampling (CPU; the timing itself needs a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from tune_moe import MODELS, candidates, spread  # noqa: E402

from moe_nvfp4.configs import default_config  # noqa: E402


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("tokens", [1, 16, 64, 4096])
@pytest.mark.parametrize("limit", [2, 7, 10, 24, 1000])
def test_spread_keeps_the_default_and_covers_every_k_split(model: str, tokens: int, limit: int) -> None:
    e, k, h, i = MODELS[model]
    grid, first = candidates(tokens, e, k, h, i), default_config(tokens, e, k, h, i)
    picked = spread(grid, limit, first)
    assert picked[0] == first and len(picked) == len(set(picked)) == min(limit, len({first, *grid}))
    assert all(c.is_valid(-(-h // 128) * 128, -(-i // 128) * 128) for c in picked)
    splits = {(c.gemm1.split_k, c.gemm2.split_k) for c in grid}
    if limit - 1 >= len(splits):  # room for one of each K-split pair
        assert splits <= {(c.gemm1.split_k, c.gemm2.split_k) for c in picked[1:]}
    if tokens == 1:  # decode: both GEMMs may split K (GEMM2 only by divisors of its 6 or 112 chunks)
        assert {s1 for s1, _ in splits} == {1, 2, 4}
