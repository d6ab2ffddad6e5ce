"""What a MoE layer's kernel configs are chosen for: the layer (``LayerShape``: experts, top-k, H, I, dtype, the
routing's expert count, gated or not) and the device (``DeviceTraits``: name, capability, SM count, memory).  A
backend's config rule and tuned files (``sm90.tuned_configs``) are keyed by both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from .layouts import FragmentLayout, round_up

__all__ = ["CPU_TRAITS", "DeviceTraits", "LayerShape", "device_traits", "last_tokens_where"]

CHUNK_K = FragmentLayout().chunk_k  # K is stored padded to whole chunks of 128 (the packed weight layout)


@dataclass(frozen=True)
class DeviceTraits:
    """What a config depends on in the device: the name tuned files are keyed by, the compute capability, and
    the SM count (persistent grids and the default's tile counts scale with it).  ``device_traits`` reads them."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    memory_gib: int = 0  # tells HBM3 parts from HBM3e ones of the same SM count, for tuned_file_for


# The Triton interpreter (CPU tensors): two programs, so persistent loops still stride.
CPU_TRAITS = DeviceTraits("cpu", (0, 0), 2)


@lru_cache(maxsize=None)
def _cuda_traits(index: int) -> DeviceTraits:
    props = torch.cuda.get_device_properties(index)
    return DeviceTraits(
        props.name, (props.major, props.minor), props.multi_processor_count, round(props.total_memory / 2**30)
    )


def device_traits(device: torch.device) -> DeviceTraits:
    """The traits of ``device`` (read once per GPU); CPU_TRAITS for CPU tensors."""
    if device.type != "cuda":
        return CPU_TRAITS
    return _cuda_traits(torch.cuda.current_device() if device.index is None else device.index)


@dataclass(frozen=True)
class LayerShape:
    """What a MoE layer's configs are chosen for: local experts, top-k, H, I, activation dtype, the routing's
    expert count (``global_experts``: the expert map's length under expert parallelism, else ``experts``) and
    whether GEMM1 is gated (2I rows: gate and up) or not (I rows; expert_activation)."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: str = "bfloat16"
    global_experts: int = 0  # 0: as many as ``experts``
    gated: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: stored by name, as tuned files spell it
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not self.global_experts:
            object.__setattr__(self, "global_experts", self.experts)

    @property
    def padded_k(self) -> tuple[int, int]:
        """GEMM1's and GEMM2's K (H and I) padded to whole 128-wide chunks, as the packed layout stores them."""
        return round_up(self.hidden, CHUNK_K), round_up(self.intermediate, CHUNK_K)

    def accepts(self, cfg) -> bool:
        """Whether ``cfg`` (a backend's kernel config: ``is_valid(hidden_padded, intermediate_padded, gated)``) is
        valid for this shape's padded K dimensions."""
        return cfg.is_valid(*self.padded_k, self.gated)

    @property
    def entry_key(self) -> tuple:
        """The fields a tuned entry is matched on."""
        return self.experts, self.global_experts, self.top_k, self.hidden, self.intermediate, self.dtype, self.gated

    def flops_per_pair(self) -> int:
        """Both GEMMs' operations for one (token, expert) pair: 2 H x (2I + I) gated, 2 H x (I + I) not (the
        activation ignored)."""
        return 2 * self.hidden * self.intermediate * (3 if self.gated else 2)

    def local_pairs(self, tokens: int) -> float:
        """Expected (token, k) pairs routed to this rank's experts, with uniform routing: T k E / E_g (all T k
        without expert parallelism; half a pair for DBRX EP8 at one token)."""
        return tokens * self.top_k * self.experts / self.global_experts

    def rows_per_active_expert(self, tokens: int) -> float:
        """Expected (token, k) pairs per expert that gets any, with uniform routing: T k / (E (1 - (1 - k/E)^T))
        over the routing's E experts (the local share of both numerator and denominator cancels).  1 at one
        token; rises to T k / E once every expert is busy."""
        e, k = self.global_experts, min(self.top_k, self.global_experts)
        return tokens * k / (e * -math.expm1(tokens * math.log1p(-k / e))) if k < e else float(tokens)

    def busy_experts(self, tokens: int) -> float:
        """Expected local experts that get any (token, k) pair, with uniform routing: E (1 - (1 - k/E_g)^T)."""
        e, k = self.global_experts, min(self.top_k, self.global_experts)
        return self.experts * (1.0 if k == e else -math.expm1(tokens * math.log1p(-k / e)))

    def decode_tiles(self, tokens: int, n: int, block_m: int, block_n: int) -> float:
        """Expected output tiles of a GEMM with N = ``n`` at ``tokens`` (busy experts x token tiles x N tiles)."""
        return self.busy_experts(tokens) * math.ceil(self.rows_per_active_expert(tokens) / block_m) * -(-n // block_n)

    def tokens_up_to_rows(self, rows: float) -> int:
        """The largest T whose rows_per_active_expert is at most ``rows`` (the function rises with T)."""
        return last_tokens_where(lambda t: self.rows_per_active_expert(t) <= rows)


def last_tokens_where(holds: Callable[[int], bool]) -> int:
    """The largest T >= 1 for which ``holds`` (true up to some T, false from there on; 1 if it never holds)."""
    lo, hi = 1, 1
    while holds(hi * 2):
        hi *= 2
    hi *= 2
    while hi - lo > 1:  # holds(lo) or lo = 1; not holds(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo
