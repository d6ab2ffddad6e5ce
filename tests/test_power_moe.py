"""tools/power_moe.py's reading of nvidia-smi samples and their join with the timed rounds (CPU)."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from power_moe import parse_samples, reason_names, summarize  # noqa: E402

T0 = datetime(2026, 11, 26, 2, 15, 44, tzinfo=timezone.utc).timestamp()


def _line(dt: float, sm: int, watts: float, reasons: int) -> str:
    stamp = datetime.fromtimestamp(T0 + dt, timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {sm} MHz, 3201 MHz, {watts:.2f} W, 51, 0x{reasons:016x}"


def test_samples_parse_and_join_the_rounds_they_fall_in() -> None:
    lines = [
        _line(0.05, 1980, 150.0, 0x0),
        _line(0.15, 1950, 420.5, 0x4),
        _line(0.25, 1890, 690.25, 0x4),
        _line(0.35, 1935, 688.0, 0x4 | 0x20),
        "2026/11/26 02:15:4",
        "",
        _line(0.95, 1980, 120.0, 0x1),
    ]
    samples = parse_samples(lines)
    assert len(samples) == 5  # the cut line and the empty one are skipped
    assert abs(samples[2].t - (T0 + 0.25)) < 1e-3 and samples[2].watts == 690.25 and samples[2].reasons == 0x4
    rounds = [
        dict(round=0, start=T0, end=T0 + 0.1, us=207.2),
        dict(round=1, start=T0 + 0.1, end=T0 + 0.4, us=211.0),
        dict(round=2, start=T0 + 0.5, end=T0 + 0.9, us=209.0),
    ]
    rows = summarize(rounds, samples)
    assert rows[0]["samples"] == 1 and rows[0]["throttle"] == [] and rows[0]["sm_mhz_min"] == 1980
    hot = rows[1]
    assert hot["samples"] == 3 and hot["us"] == 211.0
    assert hot["sm_mhz_median"] == 1935 and hot["sm_mhz_min"] == 1890
    assert hot["watts_max"] == 690.25 and hot["watts_median"] == 688.0 and hot["celsius_max"] == 51
    assert hot["throttle"] == ["sw_power_cap", "sw_thermal"]  # every reason any sample inside names
    assert rows[2] == {**rounds[2], "samples": 0}  # no sample inside: nothing made up


def test_unnamed_throttle_bits_are_kept_raw() -> None:
    assert reason_names(0x0) == []
    assert reason_names(0x4) == ["sw_power_cap"]
    assert reason_names(0x1004) == ["sw_power_cap", "0x1004"]


def test_samples_reach_the_last_round(tmp_path: Path, monkeypatch) -> None:
    """nvidia-smi keeps sampling to the end however much it writes (a pipe read only at the end filled at 64 KiB and
    stalled it, so late rounds had no sample): a stand-in writes 200 lines at once, then one every 5 ms."""
    import json

    import power_moe

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/usr/bin/env python3\nimport datetime, sys, time\n"
        "def line():\n"
        "    t = datetime.datetime.now(datetime.timezone.utc).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{t}, 1860 MHz, 3201 MHz, 690.00 W, 51, 0x0000000000000004' + ' ' * 400)\n"
        "for _ in range(200): line()\n"
        "while True:\n"
        "    line(); time.sleep(0.005)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")

    def rounds(forwards, count, cool_s):
        time.sleep(0.5)  # the stand-in's first 80 KiB go out meanwhile
        start = time.time()
        time.sleep(0.2)
        return [dict(round=0, start=start, end=time.time(), us=200.0)]

    monkeypatch.setattr(power_moe, "bench_forwards", lambda *a: [])
    monkeypatch.setattr(power_moe, "time_rounds", rounds)
    monkeypatch.setattr(
        sys, "argv", ["power_moe.py", "--rounds", "1", "--interval-ms", "5", "--out", str(tmp_path / "out.json")]
    )
    monkeypatch.setattr("harness.environment", lambda: {})
    assert power_moe.main() == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["rounds"][0]["samples"] >= 10 and out["rounds"][0]["throttle"] == ["sw_power_cap"]
