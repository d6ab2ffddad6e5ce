"""triton.launcher.launch's choice on the CPU: what it cannot serve goes to ``kernel[grid](...)`` with the same
arguments (the interpreter's kernels, a Triton whose internals it does not know, a registered launch hook, a pre-run
hook).  The launch itself, and the kernel it launches per specialization, are tested on a GPU
(tests/gpu/test_launcher_gpu.py)."""

from __future__ import annotations

import pytest
from triton import knobs

from moe_nvfp4.triton import launcher


class _Kernel:
    """What launch reads of a JITFunction; its caches must go unread wherever launch falls back."""

    def __init__(self, device_caches=None) -> None:
        self.calls: list[tuple] = []
        self.pre_run_hooks: list = []
        if device_caches is not None:
            self.device_caches = device_caches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


class _Unread(dict):
    def __getitem__(self, key):
        raise AssertionError("launch read the device caches where it should have fallen back")


def _falls_back(kernel: _Kernel) -> None:
    launcher.launch(kernel, (3, 2), "a", 7, BLOCK=16, num_warps=4)
    assert kernel.calls == [((3, 2), ("a", 7), {"BLOCK": 16, "num_warps": 4})]


def test_interpreted_kernels_launch_plainly() -> None:
    _falls_back(_Kernel())  # the interpreter's InterpretedFunction has no device caches


def test_unknown_triton_launches_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "INTERNALS_KNOWN", False)
    _falls_back(_Kernel(_Unread()))


@pytest.mark.skipif(not launcher.INTERNALS_KNOWN, reason="the hook chains of Triton 3.6")
def test_hooks_launch_plainly() -> None:
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_exit_hook.add(hook)
    try:
        _falls_back(_Kernel(_Unread()))
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    kernel = _Kernel(_Unread())
    kernel.pre_run_hooks.append(hook)
    _falls_back(kernel)
