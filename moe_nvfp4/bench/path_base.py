"""What every bench path is (``Path``: a forward over weight copies made up front) and the helpers they share:
``clone_tensors`` (a weight copy with its own storage) and ``short_error`` (an exception as a table row's reason).
The paths themselves: ``paths`` (ours, torch, and the registry), ``vllm_paths`` (vLLM's baselines),
``batched_paths`` (the batched format's)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["Path", "clone_tensors", "short_error"]


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0][:160] if text else ""
    if type(exc).__name__ == "OutOfMemoryError":  # torch's; said plainly, since a row shows it as its reason
        return f"does not fit in GPU memory (OutOfMemoryError: {first})"
    return f"{type(exc).__name__}: {first}"


def clone_tensors(obj: Any) -> Any:
    """A copy of a dataclass / tuple of tensors with every tensor cloned (new storage, same layout); of a torch
    Module, a shallow copy whose parameters and buffers are clones (its other attributes shared)."""
    import copy

    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, torch.nn.Module):
        twin = copy.copy(obj)
        twin._parameters = {
            k: torch.nn.Parameter(v.detach().clone(), requires_grad=False) for k, v in obj._parameters.items()
        }
        twin._buffers = {k: v.clone() for k, v in obj._buffers.items()}
        return twin
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: clone_tensors(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, (tuple, list)):
        return type(obj)(clone_tensors(x) for x in obj)
    return obj


# The paths.  Each is built on make_weights' experts holding ``copies`` weight copies (clones made up front);
# fn(copy, ...) is one forward of a copy.
class Path:
    name: str
    label: str  # in table headers and summaries
    weights = "nvfp4"  # what it reads: the NVFP4 experts (its error is checked), or "bf16", their dequantized copy
    requires: tuple[str, ...] = ()  # modules it imports: --paths auto takes it where all of them are installed
    auto_unless: tuple[str, ...] = ()  # ... and none of these (a fallback baseline)
    graphable = True  # whether a CUDA graph can capture its forward (False: it synchronises with the host)
    error_floor = 0.0  # its own rounding error against the reference, under which it is never a mismatch
    weight_bytes_factor = 1.0  # its weights' bytes as a multiple of what ``weights`` names (L2 rotation)

    def __init__(self, copies: int):
        self.copies_wanted = copies
        self.weights: list[Any] = []

    def add_copies(self, first: Any) -> None:
        self.weights = [first] + [clone_tensors(first) for _ in range(self.copies_wanted - 1)]

    def fn(self, copy: int, x, topk_weights, topk_ids, expert_map=None) -> Callable[[], Any]:
        """One forward of copy ``copy`` (``expert_map``: int32 [global E], -1 for experts on other ranks)."""
        raise NotImplementedError

    def tokens_out(self, out, x, topk_weights, topk_ids, expert_map=None):
        """A forward's output as [T, H] (the batched paths weight and sum their [E, T, H] rows back)."""
        return out
