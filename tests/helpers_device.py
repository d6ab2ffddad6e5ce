"""A GPU as torch.cuda reports it, faked for the CPU tests of the commands' device choice (demo, bench)."""

from __future__ import annotations

import torch


def fake_gpu(monkeypatch, *, available: bool, capability=(9, 0), name="NVIDIA H200") -> None:
    """torch.cuda says a GPU is there (or not), of this capability and name."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
