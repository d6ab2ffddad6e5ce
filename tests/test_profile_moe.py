"""tools/profile_moe.py's --ncu, --per-launch and --host modes (CPU: the CUDA calls are recorded, not made)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from profile_moe import one_forward_for_ncu  # noqa: E402


def test_ncu_mode_profiles_exactly_the_fourth_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """ncu --profile-from-start off then sees one forward, compiled and warm, and every kernel of it finished."""
    events: list[str] = []
    cudart = type(
        "Cudart",
        (),
        {
            "cudaProfilerStart": lambda self: events.append("start"),
            "cudaProfilerStop": lambda self: events.append("stop"),
        },
    )()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    one_forward_for_ncu(lambda: events.append("forward"))
    assert events == ["forward"] * 3 + ["sync", "start", "forward", "sync", "stop"]


def test_per_launch_lists_each_launch_in_order(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--per-launch prints every launch of one forward in launch order (GEMM1 and GEMM2 share a kernel name, so
    the per-name sum cannot tell them apart)."""
    import profile_moe

    launches = [("_moe_gemm_ws_kernel", 8.25), ("_moe_gemm_ws_kernel", 5.0), ("_combine_kernel", 1.1)]
    monkeypatch.setattr(profile_moe, "forward_of", lambda model, tokens, cfg: None)
    monkeypatch.setattr(profile_moe, "kernel_times", lambda forward: launches)
    monkeypatch.setattr(sys, "argv", ["profile_moe.py", "--tokens", "1", "--per-launch"])
    assert profile_moe.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2"]
    assert "8.2 us" in lines[0] and "5.0 us" in lines[1] and lines[2].endswith("_combine_kernel")


def test_host_mode_splits_the_hosts_time_from_the_wall_time(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--host: three warm forwards, then iters with the GPU waited for (wall), iters without (the host's enqueue),
    iters under cProfile; the report names the functions that took the host's time."""
    import time

    import profile_moe

    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(len(calls)))
    calls: list[int] = []

    def slow_python_forward() -> None:
        calls.append(1)
        time.sleep(0.002)

    times = profile_moe.host_times(slow_python_forward, iters=5)
    assert len(calls) == 3 + 3 * 5 and syncs == [3, 8, 13, 18]
    assert times["wall_us"] >= 2000 and times["enqueue_us"] >= 2000
    assert any("slow_python_forward" in where or "sleep" in where for _, where in times["top"][:2])
    monkeypatch.setattr(profile_moe, "api_forward_of", lambda model, tokens, w4a8: slow_python_forward)
    monkeypatch.setattr(sys, "argv", ["profile_moe.py", "--tokens", "2048", "--host", "--w4a8"])
    assert profile_moe.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("qwen3-30b-a3b T=2048 W4A8, eager, launcher:") and "enqueued" in out[0]
    assert out[1].startswith("qwen3-30b-a3b T=2048 W4A8, eager, kernel[grid]:") and len(out) > 2


def test_host_ab_runs_the_plain_launches_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    """--host's A/B: the forwards alternate between the launcher and Triton's kernel[grid] path (the launcher's
    own fallback), two rounds, and the launcher is as shipped afterwards."""
    import profile_moe

    from moe_nvfp4.triton import launcher

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen: list[bool] = []
    shipped = launcher.INTERNALS_KNOWN
    best = profile_moe.launcher_ab(lambda: seen.append(launcher.INTERNALS_KNOWN), rounds=2, iters=2)
    assert set(best) == {"launcher", "kernel[grid]"}
    per_call = 3 + 2 * 2  # warm forwards, then the wall and the enqueue loops
    expected = ([shipped] * per_call + [False] * per_call) * 2
    assert seen == expected and launcher.INTERNALS_KNOWN == shipped


def test_modes_times_both_modes_interleaved_with_w4a8_forced(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """--modes: at each T, W4A16 and W4A8 alternate for two rounds (the least time kept); the W4A8 forwards run with
    fp8_pays' bounds at zero (W4A8 at every T) and the bounds are as shipped afterwards; the rows go to --out."""
    import json

    import profile_moe

    from moe_nvfp4.sm90 import w4a8

    shipped = w4a8.FP8_MIN_ROWS_PER_EXPERT, w4a8.FP8_MIN_EAGER_FLOPS
    seen: list[tuple[str, int]] = []
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(profile_moe, "layer_inputs", lambda model, tokens: ("w", x, "tw", "ti"))
    monkeypatch.setattr(profile_moe, "prepare_fp8_weights", lambda weights: "fp8")

    def fake_fused_moe(x, weights, tw, ti, fp8_weights=None):
        bounds = w4a8.FP8_MIN_ROWS_PER_EXPERT, w4a8.FP8_MIN_EAGER_FLOPS
        seen.append(("w4a8" if fp8_weights == "fp8" else "w4a16", bounds))

    walls = iter([500.0, 700.0, 480.0, 650.0] * 2)

    def fake_host_times(forward, iters, top):
        forward()
        wall = next(walls)
        return {"wall_us": wall, "enqueue_us": wall / 2, "top": []}

    monkeypatch.setattr(profile_moe, "fused_moe", fake_fused_moe)
    monkeypatch.setattr(profile_moe, "host_times", fake_host_times)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test device")
    out = tmp_path / "modes.json"
    argv = ["profile_moe.py", "--modes", "--models", "qwen3-30b-a3b", "--token-list", "1024,2048", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert profile_moe.main() == 0
    assert [name for name, _ in seen] == ["w4a16", "w4a8"] * 4 and all(bounds == (0, 0.0) for _, bounds in seen)
    assert (w4a8.FP8_MIN_ROWS_PER_EXPERT, w4a8.FP8_MIN_EAGER_FLOPS) == shipped
    result = json.loads(out.read_text())
    rows, meta = result["rows"], result["meta"]
    assert meta["device"] == "test device" and meta["command"].startswith("python profile_moe.py --modes")
    assert meta["tuned_entries"] is False and all(r["w4a16_config"] == "default" for r in rows)
    assert [r["tokens"] for r in rows] == [1024, 2048] and rows[0]["rows_per_expert"] == 1024 * 8 / 128
    assert rows[0]["w4a16_wall_us"] == 480.0 and rows[0]["w4a8_wall_us"] == 650.0
    assert rows[0]["w4a8_speedup"] == round(480 / 650, 3) and rows[0]["w4a8_enqueue_us"] == 325.0
