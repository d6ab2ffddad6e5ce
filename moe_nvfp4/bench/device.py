"""Which device ``moe-nvfp4 demo`` and ``moe-nvfp4 bench`` run on, and the one-line refusal where they cannot."""
from __future__ import annotations

__all__ = ["DEVICES", "SUPPORTED_CAPABILITY", "SUPPORTED_GPUS", "DeviceError", "pick_device"]

DEVICES = ("auto", "cuda", "cpu")
# The fused W4A16 kernel's tuned and tested target (dispatch.py sends other GPUs to the same Triton code, untested).
SUPPORTED_CAPABILITY = (9, 0)
SUPPORTED_GPUS = "sm_90 GPUs (H100, H200, GH200)"


class DeviceError(RuntimeError):
    """The requested device cannot run the command; the message is the whole explanation (one line)."""


def pick_device(requested: str) -> str:
    """'cuda' or 'cpu' for ``--device requested``: auto takes the GPU where torch sees one, else the CPU.  A GPU
    that is not sm_90 is refused (auto included), as is cuda where torch sees no GPU."""
    import torch

    if requested not in DEVICES:
        raise DeviceError(f"--device {requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        if requested == "auto":
            return "cpu"
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"--device cuda, but torch {torch.__version__} ({build}) sees no CUDA GPU; --device cpu "
                          "runs on the CPU")  # fmt: skip
    capability = torch.cuda.get_device_capability(0)
    if tuple(capability) != SUPPORTED_CAPABILITY:
        raise DeviceError(f"{torch.cuda.get_device_name(0)} is sm_{capability[0]}{capability[1]}; the fused kernel "
                          f"supports {SUPPORTED_GPUS}; --device cpu runs the torch reference instead")  # fmt: skip
    return "cuda"
