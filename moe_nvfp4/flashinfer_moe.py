"""The ``flashinfer`` backend of the W4A4 MoE (sm_100/sm_103): FlashInfer's TRT-LLM-gen NVFP4 fused MoE,
``flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe`` with pre-computed routing, the kernel vLLM 0.26 runs for
``modelopt_fp4`` on Blackwell.  This module lays our checkpoint tensors out for it once (``prepare_moe_weights_
flashinfer``) and marshals each forward's arguments (``fused_moe_w4a4_flashinfer``).  FlashInfer is imported at the
first forward only: packing runs anywhere, CPU included.

The layout, as vLLM 0.26 builds it (``prepare_static_weights_for_trtllm_fp4_moe``), per expert:
  pad     I to a multiple of 64 (2 I rows fill whole 128-row scale tiles), H to a multiple of 256; zero codes and
          zero scales, so padding contributes nothing;
  w13     rows [up, gate], then interleaved one by one (up_0, gate_0, up_1, ...: ``reorder_rows_for_gated_act_gemm``),
          then shuffled within blocks of 32 rows for the 128-row epilogue tile (``shuffle_matrix_a``);
  w2      rows shuffled the same way;
  scales  the same row permutation as their values, then the 128x4 swizzle (``block_scale_interleave``).
In the kernel's SwiGLU, ``out1 = scale_c * up_acc * silu(scale_gate * gate_acc)`` (FlashInfer's
``trtllm/batched_gemm/KernelRunner.h``), so gate and up keep their own global scales exactly: scale_gate =
a13 * gs_gate, scale_c = a13 * gs_up / a2 (the second GEMM's input is quantized with 1 / a2).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .formats import NVFP4, NVFP4Tensor
from .layouts import swizzle_scales_128x4, unswizzle_scales_128x4

__all__ = ["MoEWeightsFlashInfer", "prepare_moe_weights_flashinfer", "fused_moe_w4a4_flashinfer", "gated_rows_order",
           "shuffle_rows_order", "flashinfer_moe_path", "INTERMEDIATE_ALIGN", "HIDDEN_ALIGN"]  # fmt: skip

INTERMEDIATE_ALIGN = 64
HIDDEN_ALIGN = 256
SHUFFLE_BLOCK = 32  # rows per shuffle block: FlashInfer's choice for a 128-row epilogue tile (vLLM's value)
SWIGLU = 3  # flashinfer.ActivationType.Swiglu
ROUTING_PRECOMPUTED = 1  # routing_method_type: unused with pre-computed routing (vLLM passes 1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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
class MoEWeightsFlashInfer:
    """Expert weights in the layout of FlashInfer's TRT-LLM-gen NVFP4 MoE (module docstring).

    w13 uint8 [E, 2 I_pad, H_pad/2], w13_scale float8_e4m3fn [E, 2 I_pad, H_pad/16] (128x4-swizzled per expert),
    w2 uint8 [E, H_pad, I_pad/2], w2_scale float8_e4m3fn [E, H_pad, I_pad/16], gate_up_global fp32 [E, 2]
    (gate, up), w2_global fp32 [E]; ``expert_offset``: the global id of local expert 0 (expert parallelism).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    gate_up_global: torch.Tensor
    w2_global: torch.Tensor
    hidden: int
    intermediate: int
    expert_offset: int = 0

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """The six tensors in the order the custom op carries them (``from_tensors`` reverses it)."""
        return [self.w13, self.w13_scale, self.w2, self.w2_scale, self.gate_up_global, self.w2_global]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], hidden: int, intermediate: int,
                     expert_offset: int) -> "MoEWeightsFlashInfer":  # fmt: skip
        return cls(*tensors, hidden=hidden, intermediate=intermediate, expert_offset=expert_offset)

    def to_nvfp4(self) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """Back to the checkpoint layout (gate rows then up rows, linear scales): the reference's input."""
        e, h, i = self.num_experts, self.hidden, self.intermediate
        i_pad, h_pad = self.w2.shape[2] * 2, self.w2.shape[1]
        w13_rows = gated_rows_order(2 * i_pad)[shuffle_rows_order(2 * i_pad)]
        w2_rows = shuffle_rows_order(h_pad)

        def undo(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            linear = unswizzle_scales_128x4(scales.view(torch.uint8), values.shape[1], values.shape[2] * 2 // 16)
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(rows.numel())
            return values[:, inverse.to(values.device)], linear[:, inverse.to(values.device)]

        v13, s13 = undo(self.w13, self.w13_scale, w13_rows)
        up, gate = (slice(0, i), slice(i_pad, i_pad + i))
        w13 = NVFP4Tensor(torch.cat((v13[:, gate, : h // 2], v13[:, up, : h // 2]), 1),
                          torch.cat((s13[:, gate, : h // 16], s13[:, up, : h // 16]), 1).view(NVFP4.scale_dtype),
                          self.gate_up_global)  # fmt: skip
        v2, s2 = undo(self.w2, self.w2_scale, w2_rows)
        w2 = NVFP4Tensor(v2[:, :h, : i // 2], s2[:, :h, : i // 16].view(NVFP4.scale_dtype), self.w2_global)
        return w13, w2


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, R, C] -> [E, rows, cols], zeros right and below."""
    out = t.new_zeros(t.shape[0], rows, cols)
    out[:, : t.shape[1], : t.shape[2]] = t
    return out


def prepare_moe_weights_flashinfer(w13: NVFP4Tensor, w2: NVFP4Tensor, *, expert_offset: int = 0) -> MoEWeightsFlashInfer:
    """Validated checkpoint tensors (``api._validated``: linear scales, w13 [E, 2I, H] gate rows then up rows with
    global [E, 2]; w2 [E, H, I] with global [E]) -> the FlashInfer layout, on their device."""
    e, h, i = w13.packed.shape[0], w13.k, w2.k
    i_pad, h_pad = _round_up(i, INTERMEDIATE_ALIGN), _round_up(h, HIDDEN_ALIGN)
    w13_rows = gated_rows_order(2 * i_pad)[shuffle_rows_order(2 * i_pad)].to(w13.packed.device)
    w2_rows = shuffle_rows_order(h_pad).to(w2.packed.device)

    def up_gate(t: torch.Tensor, cols: int) -> torch.Tensor:
        """[E, 2I, C] gate then up -> [E, 2 I_pad, cols] up then gate, each padded."""
        return torch.cat((_pad(t[:, i:], i_pad, cols), _pad(t[:, :i], i_pad, cols)), 1)

    s13 = up_gate(w13.block_scale.view(torch.uint8), h_pad // 16)[:, w13_rows]
    s2 = _pad(w2.block_scale.view(torch.uint8), h_pad, i_pad // 16)[:, w2_rows]
    return MoEWeightsFlashInfer(
        w13=up_gate(w13.packed, h_pad // 2)[:, w13_rows].contiguous(),
        w13_scale=swizzle_scales_128x4(s13).view(NVFP4.scale_dtype),
        w2=_pad(w2.packed, h_pad, i_pad // 2)[:, w2_rows].contiguous(),
        w2_scale=swizzle_scales_128x4(s2).view(NVFP4.scale_dtype),
        gate_up_global=w13.global_scale.float().contiguous(),
        w2_global=w2.global_scale.float().contiguous(),
        hidden=h,
        intermediate=i,
        expert_offset=expert_offset,
    )


def fused_moe_w4a4_flashinfer(
    x: torch.Tensor,
    weights: MoEWeightsFlashInfer,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    global_experts: int,
    input_scales: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """W4A4 MoE forward on FlashInfer's kernel -> [T, H] in x's dtype (inputs checked by ``api.fused_moe_w4a4``).

    topk_ids are global expert ids (``global_experts`` of them); this rank holds experts ``expert_offset`` ..
    ``expert_offset + E - 1``.  ``input_scales``: GEMM1's and GEMM2's ModelOpt ``input_scale`` (multipliers).
    Launches: FlashInfer's quantizer (linear scales, as the kernel reads them), then its fused MoE."""
    import flashinfer
    from flashinfer.fused_moe import trtllm_fp4_block_scale_routed_moe

    a13, a2 = (s.reshape(1).float() for s in input_scales)
    t, h = x.shape
    h_pad = weights.w13.shape[2] * 2
    if t == 0:
        return torch.empty_like(x)
    x_in = torch.nn.functional.pad(x.to(torch.bfloat16), (0, h_pad - h))
    x_fp4, x_scale = flashinfer.fp4_quantize(x_in, 1.0 / a13, sf_vec_size=NVFP4.block_size, sf_use_ue8m0=False,
                                             is_sf_swizzled_layout=False)  # fmt: skip
    out = torch.empty(t, h_pad, dtype=torch.bfloat16, device=x.device)
    gs = weights.gate_up_global
    trtllm_fp4_block_scale_routed_moe(
        topk_ids=(topk_ids.to(torch.int32), topk_weights.to(torch.bfloat16)),
        routing_bias=None,
        hidden_states=x_fp4,
        hidden_states_scale=x_scale.view(NVFP4.scale_dtype).reshape(t, h_pad // NVFP4.block_size),
        gemm1_weights=weights.w13,
        gemm1_weights_scale=weights.w13_scale,
        gemm1_bias=None,
        gemm1_alpha=None,
        gemm1_beta=None,
        gemm1_clamp_limit=None,
        gemm2_weights=weights.w2,
        gemm2_weights_scale=weights.w2_scale,
        gemm2_bias=None,
        output1_scale_scalar=(a13 * gs[:, 1] / a2).contiguous(),
        output1_scale_gate_scalar=(a13 * gs[:, 0]).contiguous(),
        output2_scale_scalar=(a2 * weights.w2_global).contiguous(),
        num_experts=global_experts,
        top_k=topk_ids.shape[1],
        n_group=0,
        topk_group=0,
        intermediate_size=weights.w2.shape[2] * 2,
        local_expert_offset=weights.expert_offset,
        local_num_experts=weights.num_experts,
        routed_scaling_factor=None,
        routing_method_type=ROUTING_PRECOMPUTED,
        do_finalize=True,
        activation_type=SWIGLU,
        output=out,
    )
    return out[:, :h].to(x.dtype)


def flashinfer_moe_path(
    w13: NVFP4Tensor, w2: NVFP4Tensor, *, top_k: int, max_tokens: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """FlashInfer's NVFP4 MoE for Hopper, as a benchmark path: the cuTile NVFP4-weight x BF16-activation backend
    (``CuTileNvfp4Bf16Config``, FlashInfer >= 0.7.1, which lists sm_89/sm_90/sm_120/sm_121 for it; not the vLLM
    0.26 bundle's 0.6.14, docs/design/005-backends.md says how to install it beside the bundle).

    w13 [E, 2I, H] (gate rows then up rows, global [E] or [E, 2] multipliers), w2 [E, H, I], CUDA tensors with
    linear scales; H and I multiples of 64.  Weights are prepared once here; returns ``run(x bf16 [T, H],
    topk_weights [T, k], topk_ids [T, k]) -> bf16 [T, H]`` for any T <= max_tokens (the first call of each
    token-count bucket autotunes and compiles)."""
    from flashinfer.fused_moe import (
        BackendOptions, CuTileNvfp4Bf16Config, ExecutionConfig, ExpertConfig, MoEActivationPack, MoEConfig, MoELayer,
        MoEWeightPack, QuantConfig, QuantFormat, RoutingConfig,
    )  # fmt: skip
    from flashinfer.fused_moe.runners import CuTileNvfp4Bf16Runner

    w13, w2 = w13.linear_scales(), w2.linear_scales()
    e, h, i = w13.packed.shape[0], w13.k, w2.k
    gs13 = w13.global_scale.float()
    gs13 = (gs13[:, None].expand(e, 2) if gs13.dim() == 1 else gs13)[:, [1, 0]]  # FlashInfer's order: up, gate

    def up_gate(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[:, i:], t[:, :i]), 1).contiguous()

    view = CuTileNvfp4Bf16Config.prepare_weights(
        up_gate(w13.packed), up_gate(w13.block_scale), gs13.contiguous(), w2.packed.contiguous(),
        w2.block_scale.contiguous(), w2.global_scale.float().contiguous(), num_local_experts=e, hidden_size=h,
        intermediate_size=i, source_format="modelopt",
    )  # fmt: skip
    weights = MoEWeightPack()
    weights.prepare_for(CuTileNvfp4Bf16Runner.backend_key, view)
    layer = MoELayer(MoEConfig(
        routing=RoutingConfig(num_experts=e, top_k=top_k),
        quant=QuantConfig(weight=QuantFormat.NVFP4, activation=QuantFormat.BF16),
        experts=ExpertConfig(intermediate_size=i),
        backend=BackendOptions(candidates=(CuTileNvfp4Bf16Config(),)),
        execution=ExecutionConfig(tune_max_num_tokens=max_tokens),
    ), device=w13.packed.device)  # fmt: skip

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        pack = MoEActivationPack(x, None, topk_ids.to(torch.int32), topk_weights.float())
        return layer(pack, weights)

    return run
