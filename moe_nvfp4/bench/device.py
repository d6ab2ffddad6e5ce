"""Which device ``moe-nvfp4 demo`` and ``moe-nvfp4 bench`` run on, and the one-line refusal where they cannot.

A GPU is accepted where the fused W4A16 MoE's backend has run on hardware (``backends.Backend.ran_on``: sm_90
today); dispatch would send other GPUs from sm_80 on to the same Triton code, but nothing has checked it there.
"""

from __future__ import annotations

from ..backends import DEFAULT_ORDER

__all__ = ["DEVICES", "DeviceError", "pick_device", "verified_archs"]

DEVICES = ("auto", "cuda", "cpu")
_GPUS = {"sm_90": "H100, H200, GH200", "sm_100": "B200, GB200", "sm_103": "B300, GB300"}  # for the message


class DeviceError(RuntimeError):
    """The requested device cannot run the command; the message is the whole explanation (one line)."""


def verified_archs() -> list[str]:
    """The architectures where a backend of the W4A16 MoE has run on hardware."""
    return sorted(set().union(*(b.ran_on for b in DEFAULT_ORDER["moe_w4a16"])))


def pick_device(requested: str) -> str:
    """'cuda' or 'cpu' for ``--device requested``: auto takes the GPU where torch sees one, else the CPU.  A GPU
    outside verified_archs() is refused (auto included), as is cuda where torch sees no GPU."""
    import torch

    if requested not in DEVICES:
        raise DeviceError(f"--device {requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        if requested == "auto":
            return "cpu"
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(
            f"--device cuda, but torch {torch.__version__} ({build}) sees no CUDA GPU; --device cpu runs on the CPU"
        )
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    if arch not in verified_archs():
        supported = ", ".join(f"{a} GPUs ({_GPUS[a]})" if a in _GPUS else a for a in verified_archs())
        raise DeviceError(
            f"{torch.cuda.get_device_name(0)} is {arch}; the fused kernel supports {supported}; "
            "--device cpu runs the torch reference instead"
        )
    return "cuda"
