"""The layouts ``MoEWeights`` holds its six tensors in, one per kernel family, as data: each packs validated
checkpoint tensors into the tensors of ``MoEWeights``' fields (in field order) and unpacks them back to the
checkpoint layout (the reference's input).  Backends name the layout their W4A4 MoE reads
(``backends.Backend.w4a4_layout``); the 16-bit-activation MoE always reads ``sm90_fragments``.

  sm90_fragments     the Triton/Gluon kernels (``layouts.FragmentLayout``): gate and up rows each padded to 64
                     (a non-gated activation's w13 one block of I rows), K to 128, each thread's wgmma fragment one
                     contiguous run, e5m3 scale bytes
  sm100_interleaved  our CuTe DSL kernels: K-major packed FP4, 128x4-swizzled e4m3 scales, gate and up rows
                     interleaved in blocks of ``GATE_UP_BLOCK`` (each padded to I_pad = pad32(I)); w2's K padded to I_pad
  flashinfer_trtllm  FlashInfer's TRT-LLM-gen NVFP4 MoE, as vLLM 0.26 builds it (``prepare_static_weights_for_
                     trtllm_fp4_moe``): I padded to 64, H to 256; w13 rows [up, gate] interleaved one by one
                     (``reorder_rows_for_gated_act_gemm``), then shuffled within blocks of 32 rows for the 128-row
                     epilogue tile (``shuffle_matrix_a``); w2 rows shuffled the same way; scales permuted as their
                     values, then 128x4-swizzled (``block_scale_interleave``).  Its kernel takes the local experts as
                     one contiguous range of global ids from ``expert_offset`` (expert parallelism).

Every layout's w13_global is fp32 [E, 2] (gate, up) and w2_global fp32 [E].  ``MoEWeights`` is named in annotations
only: weights.py imports this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from .formats import NVFP4, NVFP4Tensor, ScaleLayout
from .layouts import GATE_UP_BLOCK, FragmentLayout, round_up, swizzle_scales_128x4, unswizzle_scales_128x4

__all__ = [
    "MoELayout",
    "Sm90Layout",
    "Sm100Layout",
    "FlashInferLayout",
    "weight_layout",
    "padded_intermediate",
    "gated_rows_order",
    "shuffle_rows_order",
    "INTERMEDIATE_ALIGN",
    "HIDDEN_ALIGN",
    "FP8_GATE_UP_BLOCK",
    "interleave_gate_up",
    "interleaved_gate_up_rows",
    "gate_up_rows",
]

# The values a packing launch reads at most (one expert's block at least): in place, the copy set aside.
PACK_RUN_BYTES = 1 << 24
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# (packed [e, N, K/2], e4m3 scales [e, N, K/16], dst values, dst scale bytes) -> None: a run of experts' blocks into
# FragmentLayout
BlockPacker = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class MoELayout(ABC):
    """One layout of the MoE's expert weights.  ``expert_offset``: the global id of local expert 0 for a layout
    whose kernel takes the local experts as one contiguous range (the others are routed by an expert map: 0)."""

    name: ClassVar[str]
    routed_by_offset: ClassVar[bool] = False
    expert_offset: int = 0

    @abstractmethod
    def pack(self, w13: NVFP4Tensor, w2: NVFP4Tensor) -> Tensors:
        """Validated checkpoint tensors (linear scales; w13 [E, 2I, H] gate rows then up rows with global [E, 2];
        w2 [E, H, I] with global [E]) -> (w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global)."""

    @abstractmethod
    def to_nvfp4(self, weights: MoEWeights) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """``weights`` (in this layout) back to the checkpoint layout: gate rows then up rows, linear scales."""

    def expert_map_for(self, expert_map: torch.Tensor | None, num_experts: int) -> torch.Tensor | None:
        """The expert map the reference routes these weights by: ``expert_map`` where the kernel reads one."""
        return expert_map


@dataclass(frozen=True)
class Sm90Layout(MoELayout):
    name: ClassVar[str] = "sm90_fragments"
    fragments: FragmentLayout = field(default_factory=FragmentLayout)

    def pack(
        self,
        w13: NVFP4Tensor,
        w2: NVFP4Tensor,
        *,
        reuse_input_memory: bool = False,
        pack_block: BlockPacker | None = None,
    ) -> Tensors:
        """One gate/up block of a run of experts at a time.  ``pack_block(packed, scales, dst, dst_scales)`` packs
        one block of each expert of a run ([e, rows, K/2] -> [e, padded rows, padded K/2]; default: the torch twin,
        ``FragmentLayout.pack``; on the GPU the API passes the Triton kernel).  ``reuse_input_memory``: a matrix
        whose layout adds no padding is packed into its own tensors (their contents are overwritten), each run's
        block first copied aside, so the extra memory is one run (``PACK_RUN_BYTES``, at least one expert's block),
        not a layer."""
        e, h, i = w13.packed.shape[0], w13.k, w2.k
        layout = self.fragments
        pack_block = pack_block or self._pack_block

        def pack(q: NVFP4Tensor, row_blocks: tuple[tuple[int, int], ...], k: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Each (start, rows) block of q's rows becomes its own padded run of rows (gate and up stay apart)."""
            np_, kp = sum(layout.padded_n(rows) for _, rows in row_blocks), layout.padded_k(k)
            in_place = (
                reuse_input_memory
                and (np_, kp) == (q.n, k)
                and q.packed.is_contiguous()
                and q.block_scale.is_contiguous()
            )
            if in_place:
                packed, scale = q.packed, q.block_scale.view(torch.uint8)
            else:
                packed = torch.empty(e, np_, kp // 2, dtype=torch.uint8, device=q.packed.device)
                scale = torch.empty(e, np_, kp // 16, dtype=torch.uint8, device=q.packed.device)
            row = 0
            for start, rows in row_blocks:
                end = row + layout.padded_n(rows)
                per_run = max(1, PACK_RUN_BYTES // (rows * k // 2))
                for first in range(0, e, per_run):
                    experts = slice(first, min(e, first + per_run))
                    values = q.packed[experts, start : start + rows]
                    scales = q.block_scale[experts, start : start + rows]
                    if in_place:  # the block's rows are its destination: read from a copy
                        values, scales = values.clone(), scales.clone()
                    pack_block(values, scales, packed[experts, row:end], scale[experts, row:end])
                row = end
            return packed, scale

        # gate and up each padded apart; a non-gated activation's w13 ([E, I, H]) is one block
        w13_packed, w13_scale = pack(w13, ((0, i), (i, i)) if w13.n == 2 * i else ((0, i),), h)
        w2_packed, w2_scale = pack(w2, ((0, h),), i)
        return w13_packed, w13_scale, w13.global_scale, w2_packed, w2_scale, w2.global_scale.float().contiguous()

    def _pack_block(
        self, packed: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor, dst_scales: torch.Tensor
    ) -> None:
        for expert in range(packed.shape[0]):
            dst[expert], dst_scales[expert] = self.fragments.pack(packed[expert], scales[expert])

    def to_nvfp4(self, weights: MoEWeights) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        def unpack(values: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            pairs = [self.fragments.unpack(v, s, n, k) for v, s in zip(values, scales)]
            return torch.stack([p for p, _ in pairs]), torch.stack([s for _, s in pairs])

        h, i, ip = weights.hidden, weights.intermediate, self.fragments.padded_n(weights.intermediate)
        w2 = NVFP4Tensor(*unpack(weights.w2_packed, weights.w2_scale, h, i), weights.w2_global)
        if weights.w13_packed.shape[1] == ip:  # one block: a non-gated activation's w13
            return NVFP4Tensor(*unpack(weights.w13_packed, weights.w13_scale, i, h), weights.w13_global), w2
        gate = unpack(weights.w13_packed[:, :ip], weights.w13_scale[:, :ip], i, h)
        up = unpack(weights.w13_packed[:, ip:], weights.w13_scale[:, ip:], i, h)
        w13 = NVFP4Tensor(torch.cat((gate[0], up[0]), 1), torch.cat((gate[1], up[1]), 1), weights.w13_global)
        return w13, w2


def padded_intermediate(intermediate: int) -> int:
    """I_pad of ``sm100_interleaved``: gate and up each padded to whole interleave blocks (also GEMM2's K, a
    multiple of 32 for TMA)."""
    return round_up(intermediate, GATE_UP_BLOCK)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, R, C] -> [E, rows, cols], zeros right and below."""
    out = t.new_zeros(t.shape[0], rows, cols)
    out[:, : t.shape[1], : t.shape[2]] = t
    return out


@dataclass(frozen=True)
class Sm100Layout(MoELayout):
    name: ClassVar[str] = "sm100_interleaved"

    def pack(self, w13: NVFP4Tensor, w2: NVFP4Tensor) -> Tensors:
        """Needs H % 32 == 0 (16-byte TMA rows)."""
        e, hidden, inter = w13.packed.shape[0], w13.k, w2.k
        if hidden % 32:
            raise ValueError(f"hidden={hidden}; the sm_100a kernels need H % 32 == 0")
        inter_pad = padded_intermediate(inter)

        def interleave(t: torch.Tensor) -> torch.Tensor:
            """[E, 2I, C] gate then up -> [E, 2 I_pad, C]: blocks of gate rows and up rows alternate."""
            gate, up = (_pad(half, inter_pad, t.shape[2]) for half in (t[:, :inter], t[:, inter:]))
            blocks = (x.reshape(e, inter_pad // GATE_UP_BLOCK, 1, GATE_UP_BLOCK, t.shape[2]) for x in (gate, up))
            return torch.cat(tuple(blocks), 2).reshape(e, 2 * inter_pad, t.shape[2])

        w2_scale = _pad(w2.block_scale.view(torch.uint8), hidden, inter_pad // 16)
        return (
            interleave(w13.packed).contiguous(),
            swizzle_scales_128x4(interleave(w13.block_scale.view(torch.uint8))).view(NVFP4.scale_dtype),
            w13.global_scale.float().contiguous(),
            _pad(w2.packed, hidden, inter_pad // 2).contiguous(),
            swizzle_scales_128x4(w2_scale).view(NVFP4.scale_dtype),
            w2.global_scale.float().contiguous(),
        )

    def to_nvfp4(self, weights: MoEWeights) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        e, inter, hidden = weights.num_experts, weights.intermediate, weights.hidden
        inter_pad = padded_intermediate(inter)
        scales = unswizzle_scales_128x4(weights.w13_scale.view(torch.uint8), 2 * inter_pad, hidden // 16)

        def deinterleave(t: torch.Tensor) -> torch.Tensor:
            blocks = t.reshape(e, inter_pad // GATE_UP_BLOCK, 2, GATE_UP_BLOCK, t.shape[-1])
            return torch.cat([blocks[:, :, h].reshape(e, inter_pad, -1)[:, :inter] for h in (0, 1)], 1)

        w13 = NVFP4Tensor(
            deinterleave(weights.w13_packed), deinterleave(scales).view(NVFP4.scale_dtype), weights.w13_global
        )
        w2 = NVFP4Tensor(
            weights.w2_packed, weights.w2_scale, weights.w2_global, ScaleLayout.SWIZZLED_128x4
        ).linear_scales()
        w2 = NVFP4Tensor(w2.packed[..., : inter // 2], w2.block_scale[..., : inter // 16], w2.global_scale)
        return w13, w2


INTERMEDIATE_ALIGN = 64
HIDDEN_ALIGN = 256
SHUFFLE_BLOCK = 32  # rows per shuffle block: FlashInfer's choice for a 128-row epilogue tile (vLLM's value)


def shuffle_rows_order(rows: int) -> torch.Tensor:
    """int64 [rows]: new row i holds old row order[i].  In each block of 32, old row r moves to
    (r % 4) * 8 + r // 4 (TRT-LLM-gen's ``srcToDstBlk32RowMap``)."""
    if rows % SHUFFLE_BLOCK:
        raise ValueError(f"shuffle_rows_order: {rows} rows is not a multiple of {SHUFFLE_BLOCK}")
    old = torch.arange(rows)
    r = old % SHUFFLE_BLOCK
    new = old - r + (r % 4) * 8 + r // 4
    order = torch.empty_like(old)
    order[new] = old
    return order


def gated_rows_order(rows: int) -> torch.Tensor:
    """int64 [rows]: rows [first half, second half] -> alternating (first_0, second_0, first_1, ...)."""
    return torch.arange(rows).reshape(2, rows // 2).t().reshape(-1)


@dataclass(frozen=True)
class FlashInferLayout(MoELayout):
    name: ClassVar[str] = "flashinfer_trtllm"
    routed_by_offset: ClassVar[bool] = True

    def pack(self, w13: NVFP4Tensor, w2: NVFP4Tensor) -> Tensors:
        h, i = w13.k, w2.k
        i_pad, h_pad = round_up(i, INTERMEDIATE_ALIGN), round_up(h, HIDDEN_ALIGN)
        w13_rows = gated_rows_order(2 * i_pad)[shuffle_rows_order(2 * i_pad)].to(w13.packed.device)
        w2_rows = shuffle_rows_order(h_pad).to(w2.packed.device)

        def up_gate(t: torch.Tensor, cols: int) -> torch.Tensor:
            """[E, 2I, C] gate then up -> [E, 2 I_pad, cols] up then gate, each padded."""
            return torch.cat((_pad(t[:, i:], i_pad, cols), _pad(t[:, :i], i_pad, cols)), 1)

        s13 = up_gate(w13.block_scale.view(torch.uint8), h_pad // 16)[:, w13_rows]
        s2 = _pad(w2.block_scale.view(torch.uint8), h_pad, i_pad // 16)[:, w2_rows]
        return (
            up_gate(w13.packed, h_pad // 2)[:, w13_rows].contiguous(),
            swizzle_scales_128x4(s13).view(NVFP4.scale_dtype),
            w13.global_scale.float().contiguous(),
            _pad(w2.packed, h_pad, i_pad // 2)[:, w2_rows].contiguous(),
            swizzle_scales_128x4(s2).view(NVFP4.scale_dtype),
            w2.global_scale.float().contiguous(),
        )

    def to_nvfp4(self, weights: MoEWeights) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        h, i = weights.hidden, weights.intermediate
        i_pad, h_pad = weights.w2_packed.shape[2] * 2, weights.w2_packed.shape[1]
        w13_rows = gated_rows_order(2 * i_pad)[shuffle_rows_order(2 * i_pad)]
        w2_rows = shuffle_rows_order(h_pad)

        def undo(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            linear = unswizzle_scales_128x4(scales.view(torch.uint8), values.shape[1], values.shape[2] * 2 // 16)
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(rows.numel())
            return values[:, inverse.to(values.device)], linear[:, inverse.to(values.device)]

        v13, s13 = undo(weights.w13_packed, weights.w13_scale, w13_rows)
        up, gate = (slice(0, i), slice(i_pad, i_pad + i))
        w13 = NVFP4Tensor(
            torch.cat((v13[:, gate, : h // 2], v13[:, up, : h // 2]), 1),
            torch.cat((s13[:, gate, : h // 16], s13[:, up, : h // 16]), 1).view(NVFP4.scale_dtype),
            weights.w13_global,
        )
        v2, s2 = undo(weights.w2_packed, weights.w2_scale, w2_rows)
        w2 = NVFP4Tensor(v2[:, :h, : i // 2], s2[:, :h, : i // 16].view(NVFP4.scale_dtype), weights.w2_global)
        return w13, w2

    def expert_map_for(self, expert_map: torch.Tensor | None, num_experts: int) -> torch.Tensor:
        """The kernel routes by the contiguous local range, whatever the map says: a map of that range (CPU)."""
        global_experts = num_experts if expert_map is None else expert_map.numel()
        local = torch.arange(num_experts, dtype=torch.int32) + self.expert_offset
        return torch.full((global_experts,), -1, dtype=torch.int32).index_put_(
            (local.long(),), local - self.expert_offset
        )


_BY_NAME = {layout.name: layout for layout in (Sm90Layout, Sm100Layout, FlashInferLayout)}


def weight_layout(name: str, expert_offset: int = 0) -> MoELayout:
    """The layout called ``name`` (``MoELayout.name``); ``expert_offset`` is kept where its kernel routes by the
    offset (the others are routed by the expert map: 0)."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown weight layout {name!r}; known: {sorted(_BY_NAME)}")
    layout = _BY_NAME[name]
    return layout(expert_offset=expert_offset if layout.routed_by_offset else 0)


# The W4A8 mode's e4m3 copy (weights.Fp8ExpertWeights, sm90/w4a8.py): a gated w13 holds 64 gate rows, then the same
# 64 outputs' up rows, and so on, so one 128-row FP8 MMA tile makes both halves of 64 outputs.
FP8_GATE_UP_BLOCK = 64


def interleaved_gate_up_rows(i: int) -> int:
    """Rows of interleave_gate_up's result for I outputs: 2 pad64(I)."""
    return 2 * round_up(i, FP8_GATE_UP_BLOCK)


def interleave_gate_up(rows: torch.Tensor, i: int) -> torch.Tensor:
    """[E, 2I, ...] gate then up -> [E, 2 pad64(I), ...] (interleaved_gate_up_rows): FP8_GATE_UP_BLOCK gate rows,
    then the same outputs' up rows (padding rows zero)."""
    e, _, *rest = rows.shape
    blocks = interleaved_gate_up_rows(i) // (2 * FP8_GATE_UP_BLOCK)
    halves = rows.new_zeros(e, 2, blocks * FP8_GATE_UP_BLOCK, *rest)
    halves[:, :, :i] = rows.view(e, 2, i, *rest)
    return halves.view(e, 2, blocks, FP8_GATE_UP_BLOCK, *rest).transpose(1, 2).reshape(e, -1, *rest)


def gate_up_rows(interleaved: torch.Tensor, i: int) -> torch.Tensor:
    """interleave_gate_up's inverse: [E, 2 pad64(I), ...] -> [E, 2I, ...] gate then up."""
    e, rows, *rest = interleaved.shape
    blocks = rows // (2 * FP8_GATE_UP_BLOCK)
    halves = interleaved.view(e, blocks, 2, FP8_GATE_UP_BLOCK, *rest).transpose(1, 2).reshape(e, 2, -1, *rest)
    return halves[:, :, :i].reshape(e, 2 * i, *rest)
