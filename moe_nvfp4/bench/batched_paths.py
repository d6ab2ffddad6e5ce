"""The bench's batched-format paths (DeepEP low-latency's [E, T, H] rows and per-expert counts): ours
(``fused_moe_batched``) and vLLM's batched Marlin, on inputs laid out before timing as a dispatch would
(``BatchedLayout``); their output is weighted and summed back per token before the checks."""

from __future__ import annotations

from .harness import MoEShape
from .path_base import Path
from .vllm_paths import Marlin

__all__ = ["BatchedLayout", "MarlinBatched", "OursBatched"]


class BatchedLayout:
    """What a batched dispatch (DeepEP low-latency, vLLM's BatchedPrepareAndFinalize) hands the experts, built from a
    routing: x_b [E local, T, H] with expert e's tokens in its first counts[e] rows (token order), and where each
    routed (token, k) pair landed, to weight and sum the experts' rows back."""

    def __init__(self, x, topk_ids, expert_map, num_experts: int):
        import torch

        t, k = topk_ids.shape
        local = (topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]).reshape(-1)
        routed = (local >= 0) & (local < num_experts)
        key = torch.where(routed, local, num_experts)
        order = torch.sort(key, stable=True).indices
        counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
        starts = torch.cumsum(counts, 0) - counts
        n = int(counts.sum())
        self.pair, self.expert = order[:n], key[order[:n]]
        self.row = torch.arange(n, device=x.device) - starts[self.expert]
        self.counts = counts.to(torch.int32)
        self.x = torch.zeros(num_experts, max(t, 1), x.shape[1], dtype=x.dtype, device=x.device)
        self.x[self.expert, self.row] = x[self.pair // k]
        self.out = torch.empty_like(self.x)
        self.tokens = t

    def combine(self, out, topk_weights):
        import torch

        k = topk_weights.shape[1]
        rows = out[self.expert, self.row].float() * topk_weights.reshape(-1)[self.pair, None].float()
        summed = torch.zeros(self.tokens, out.shape[2], dtype=torch.float32, device=out.device)
        return summed.index_add_(0, self.pair // k, rows).to(out.dtype)


class _Batched(Path):
    requires = auto_unless = ("vllm",)  # opt-in: never in --paths auto
    graphable = True

    def layout(self, x, topk_ids, expert_map) -> BatchedLayout:
        key = (x.data_ptr(), topk_ids.data_ptr(), None if expert_map is None else expert_map.data_ptr())
        if getattr(self, "_layout_key", None) != key:
            self._layout, self._layout_key = BatchedLayout(x, topk_ids, expert_map, self.num_experts), key
        return self._layout

    def tokens_out(self, out, x, topk_weights, topk_ids, expert_map=None):
        return self.layout(x, topk_ids, expert_map).combine(out, topk_weights)


class OursBatched(_Batched):
    """moe_nvfp4.fused_moe_batched on the batched layout, the config from the rows a busy expert expects at this T
    (what integrations/moe_nvfp4_vllm/modular.py's NVFP4GroupedBatchedExperts asks for)."""

    name, label = "ours_batched", "ours batched"

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        from ..api import fused_moe_batched, prepare_moe_weights

        self.num_experts, self._call = shape.experts, fused_moe_batched
        self._shape = shape.layer
        self.add_copies(prepare_moe_weights(w13_q, w2_q, activation=shape.expert_activation))

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        layout, w, call = self.layout(x, topk_ids, expert_map), self.weights[copy], self._call
        rows = self._shape.rows_per_active_expert(x.shape[0])
        return lambda: call(layout.x, w, layout.counts, expected_rows=rows, out=layout.out)


class MarlinBatched(_Batched):
    """vLLM 0.26's batched_fused_marlin_moe, the kernel of BatchedMarlinExperts (the batched format's Marlin
    experts), on Marlin's NVFP4 weights as the marlin path prepares them, with their global scales."""

    name, label = "marlin_batched", "Marlin batched"

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import batched_fused_marlin_moe

        marlin = Marlin(shape, w13_q, w2_q, copies)
        self.weights, self._call, self.num_experts = marlin.weights, batched_fused_marlin_moe, shape.experts
        self._quant_type_id, self._activation = marlin._quant_type_id, marlin._activation
        self._input_dtype = marlin._input_dtype

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        layout, call = self.layout(x, topk_ids, expert_map), self._call
        w13, w13_s, w13_gs, w2, w2_s, w2_gs = self.weights[copy]

        def run():
            return call(
                hidden_states=layout.x,
                expert_num_tokens=layout.counts,
                w1=w13,
                w2=w2,
                bias1=None,
                bias2=None,
                w1_scale=w13_s,
                w2_scale=w2_s,
                quant_type_id=self._quant_type_id,
                global_num_experts=self.num_experts,
                activation=self._activation,
                global_scale1=w13_gs,
                global_scale2=w2_gs,
                output=layout.out,
                is_k_full=True,
                input_dtype=self._input_dtype,
            )

        return run
