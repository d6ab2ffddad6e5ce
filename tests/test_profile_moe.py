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
