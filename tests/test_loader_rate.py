"""tools/loader_rate.py's arithmetic and variant handling, and the read ceiling it compares with (CPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from moe_nvfp4.bench.harness import MoEShape, measure_copy_bandwidth, measure_read_bandwidth  # noqa: E402
from loader_rate import gemm_bytes, timed_gemms  # noqa: E402


@pytest.mark.parametrize("experts,hidden,inter", [(8, 4096, 14336), (128, 2048, 768)])
def test_gemm_bytes_split_an_experts_bytes_between_the_gemms(experts: int, hidden: int, inter: int) -> None:
    """GEMM1 reads gate and up ([2I, H], a global scale each), GEMM2 [H, I]: together an expert's NVFP4 bytes
    (MoEShape counts one global scale for w13) for every touched expert."""
    shape = MoEShape("m", experts, 2, hidden, inter)
    both = gemm_bytes("gemm1", 3, hidden, inter) + gemm_bytes("gemm2", 3, hidden, inter)
    assert both == 3 * (shape.expert_nvfp4_bytes() + 4)
    assert gemm_bytes("gemm1", 3, hidden, inter) == 3 * (2 * inter * hidden * 9 // 16 + 8)  # 4.5 bits a weight


def test_a_variant_times_the_gemm_it_changes() -> None:
    assert timed_gemms("gemm2:num_stages=3", ["gemm1"]) == ["gemm2"]
    assert timed_gemms("gemm1:chunks_per_stage=2/num_stages=4", ["gemm2"]) == ["gemm1"]
    assert timed_gemms("shipped", ["gemm1", "gemm2"]) == ["gemm1", "gemm2"]


def test_read_ceiling_counts_bytes_read_once_and_the_copy_twice() -> None:
    bps, detail = measure_read_bandwidth(nbytes=1 << 20, iters=3, device="cpu")
    assert bps > 0 and detail["bytes"] == 1 << 20
    assert bps == pytest.approx(detail["bytes"] / (detail["median_ms"] * 1e-3))
    copy_bps, copy = measure_copy_bandwidth(nbytes=1 << 20, iters=3, device="cpu")
    assert copy_bps == pytest.approx(2 * copy["bytes"] / (copy["median_ms"] * 1e-3))
