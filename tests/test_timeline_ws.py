"""tools/timeline_ws.py's summary of the probes' stamps (the GPU run writes them; here they are made up)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import timeline_ws  # noqa: E402


def test_summary_times_points_from_gemm1_start_and_phases_from_the_clock() -> None:
    """Three GEMM1 programs (one without a tile, so it is left out of the points) and two GEMM2 programs; the SM
    clock runs at 2 cycles a ns, so a phase of 200 cycles is 100 ns."""
    stamps = torch.zeros(2, timeline_ws.MAX_PROGRAMS, len(timeline_ws.EVENTS), timeline_ws.FIELDS, dtype=torch.int64)
    start = 1_000_000

    def program(g: int, p: int, t: int, phases_ns: list[int], tile: bool = True, sm: int = 0, tiles: int = 1) -> None:
        times = [t]
        for ns in phases_ns:
            times.append(times[-1] + ns)
        for e, ts in enumerate(times):
            if tile or e not in (2, 3):
                stamps[g, p, e, 0] = start + ts
                stamps[g, p, e, 1] = 5_000 + 2 * (ts - t)  # cycles since this program's start
        stamps[g, p, 5, 0] = start + t + 50  # the loader's wait
        stamps[g, p, :, 2] = sm
        stamps[g, p, 4, 3] = tiles if tile else 0

    program(0, 0, 0, [100, 1000, 4000, 500], sm=7, tiles=2)
    program(0, 1, 40, [120, 1100, 4200, 600], sm=7, tiles=1)
    program(0, 2, 10, [100, 200, 300, 400], tile=False, sm=3)
    program(1, 0, 3000, [5000, 800, 2000, 300], sm=1)
    program(1, 1, 3100, [5200, 900, 2100, 320], sm=2)
    summary = timeline_ws.summarize(stamps, (3, 2))
    g1, g2 = summary["gemm1"], summary["gemm2"]
    assert g1["programs_with_tiles"] == 2 and g2["programs_with_tiles"] == 2
    assert g1["clock_ghz"] == 2.0 and g2["clock_ghz"] == 2.0
    assert g1["points_ns"]["mma_start"] == dict(first=0, median=20, last=40)
    assert g1["points_ns"]["first_stage"] == dict(first=1100, median=1180, last=1260)
    assert g2["points_ns"]["mma_end"]["last"] == 3100 + 5200 + 900 + 2100 + 320
    assert g1["phases_ns"]["first_stage -> first_tile_k_done"] == 4100
    assert g2["phases_ns"]["mma_start -> mma_waited"] == 5100
    # per SM: GEMM1's two programs share SM 7 (3 tiles, its last program ending at 40 + 6020 ns; its first stage at
    # 1100 ns), GEMM2's run one tile on each of two SMs
    assert g1["per_sm"]["by_tiles"] == {3: dict(sms=1, end_first=6060, end_median=6060, end_last=6060)}
    assert g1["per_sm"]["ns_per_tile"]["median"] == (6060 - 1100) / 3
    assert g2["per_sm"]["by_tiles"][1]["sms"] == 2
    assert g2["per_sm"]["by_tiles"][1]["end_last"] == 3100 + 5200 + 900 + 2100 + 320
