"""tools/profile_moe.py's --ncu mode (CPU: the CUDA calls are recorded, not made)."""

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
