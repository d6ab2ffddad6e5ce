"""The sm_90 MoE's host: the forward of the 16-bit-activation MoE on Hopper (the ``triton`` backend's ``moe_w4a16``
and ``moe_w4a16_batched`` entries, backends.py), from the checked inputs to the launches.

Launches per forward (each grid sized from the SM count or T, never from routing data):
  1. ``_route_kernel``   per-expert counts/offsets, pairs grouped by expert, the tile map: one program up
     to ROUTE_ONE_PROGRAM pairs; past that one per chunk of pairs, after ``_count_kernel`` counted them.
     None with pair tiles (MoEKernelConfig.pair_tiles): the Gluon GEMMs (gemm_gluon) then take every
     (token, k) pair as a one-row tile, its expert read from topk_ids.
  2. GEMM1 (gemm_triton or gemm_gluon, per config): gathers token rows of x, decodes w13 in registers, SiLU(gate) *
     up (or the weights' other activation, bias added: common.Epilogue).
  3. GEMM2: decodes w2, adds the bias, writes one row per (token, k) pair into a float32 buffer (or one in x's
     dtype, per config).
  4. ``_combine_kernel`` sums each token's pairs times their top-k weights in a fixed order: deterministic, no
     atomics on data.
Routing (triton.routing_kernels) and the combine (triton.combine) are modules of their own: the Blackwell host
launches them too.  vLLM's batched format (``fused_moe_batched_sm90``) runs the same two GEMMs on a plan built from
per-expert counts (``route_batched``): each row of x [E, max_tokens, H] is a pair of its own, GEMM2 writes the
batched output, no combine.
"""

from __future__ import annotations

import dataclasses

import torch

from ..dispatch import sm_count
from ..layouts import rows_16_aligned
from ..shapes import LayerShape, device_traits
from ..weights import MoEWeights
from ..triton.combine import _combine_kernel, combine
from ..triton.routing_kernels import _batched_route_kernel, _count_kernel, _route_kernel, route, route_batched
from .common import Epilogue, GemmRouting, GemmWeights
from .configs import MoEKernelConfig
from .gemm_gluon import launch_gemm_ws
from .gemm_triton import _moe_gemm_kernel, launch_gemm
from .tuned_configs import select_config

__all__ = ["batched_config", "compiled_variants", "fused_moe_batched_sm90", "fused_moe_sm90", "run_batched"]


def compiled_variants() -> int:
    """How many kernel variants Triton has compiled in this process (all kernels here, all devices)."""
    kernels = (_count_kernel, _route_kernel, _batched_route_kernel, _moe_gemm_kernel, _combine_kernel)
    # device_caches: device -> (kernel cache, ...) in Triton 3.x; the interpreter has none.
    return sum(len(caches[0]) for k in kernels for caches in getattr(k, "device_caches", {}).values())


def _gluon_rows_ok(x: torch.Tensor, intermediate: int) -> bool:
    """Whether the warp-specialized Gluon GEMMs can run: sm_90 code whose cp.async row copies are 16 bytes,
    compiled only where the JIT marks the row pointers and strides 16-divisible.  The interpreter (CPU tensors)
    and other rows run the Triton kernel with the same tiles, which computes the same sums."""
    return x.is_cuda and rows_16_aligned(x) and intermediate % 16 == 0


def _gemm_routing(
    config: MoEKernelConfig,
    both_gluon: bool,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_experts: int,
) -> GemmRouting:
    """What both GEMMs read of the routing: the routing kernels' tile map, or with pair tiles none."""
    # pair tiles: the Gluon GEMMs take each pair's expert from topk_ids (and the expert map), and both GEMMs must
    # number rows alike
    pair_tiles = config.pair_tiles and both_gluon
    if pair_tiles:
        # no routing launch; the tile-map arguments go unread: a 16-byte aligned stand-in (as route()'s buffers
        # are), so which variant compiles never depends on topk_ids' alignment
        tile_map = (torch.empty(4, dtype=torch.int32, device=topk_ids.device),) * 5
    else:
        sorted_pairs, _, _, *tiles = route(topk_ids, num_experts, config.block_m, expert_map)
        tile_map = (sorted_pairs, *tiles)  # the GEMMs read each tile's expert and rows, not the per-expert runs
    return GemmRouting(tile_map, topk_ids.reshape(-1), expert_map, pair_tiles)


def fused_moe_sm90(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    config: MoEKernelConfig | None = None,
    out: torch.Tensor | None = None,
    *,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Host wrapper: shapes are checked by the caller (api.fused_moe); launches the four kernels, three with
    pair tiles (MoEKernelConfig.pair_tiles, both GEMMs warp-specialized): no routing.  Pairs routed nowhere
    (routing.routed_pairs: ids or expert-map entries out of range) contribute nothing on every path.

    ``config``: configs.select_config's for this call's shape where None (tests and the tuner pass their own).
    The variant (the weights' activation and biases, the router weight on the input) reaches the GEMMs as
    common.Epilogue; with ``apply_router_weight_on_input`` GEMM1 reads each pair's row x[t] * w[t, j]
    (rounded to x's dtype, one elementwise pass) instead of x[t], and GEMM2 weights nothing."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, intermediate = weights.num_experts, weights.intermediate
    out = torch.empty_like(x) if out is None else out
    if t == 0:
        return out
    if config is None:
        config = select_config(t, weights.layer_shape(top_k, x.dtype, expert_map), device_traits(x.device))
    gather = 1 if apply_router_weight_on_input else top_k  # GEMM1's A row of pair p: p // gather
    if apply_router_weight_on_input:  # one row per pair, as vLLM rounds it: a1 * topk_weights.to(a1.dtype)
        x = (x[:, None, :] * topk_weights.to(x.dtype)[:, :, None]).reshape(t * top_k, hidden)
    epilogue1 = Epilogue.of(weights.w13_bias, weights.activation)
    epilogue2 = Epilogue.of(weights.w2_bias, None)
    ws_ok = _gluon_rows_ok(x, intermediate)
    if x.is_cuda and not ws_ok and config.block_m < 16:
        # 8-token tiles are valid only where both GEMMs are Gluon (MoEKernelConfig.is_valid): the Triton GEMM takes
        # them as mma.sync tiles, and rows it had to take in their place gave 0.95 relative error on an H200 (x a
        # column slice of a wider buffer, 2026-11-28; the API copies such rows, so only direct callers get here)
        config = config.with_token_tile(16)
    ws1, ws2 = config.gemm1.warp_specialized and ws_ok, config.gemm2.warp_specialized and ws_ok
    routing = _gemm_routing(config, ws1 and ws2, topk_ids, expert_map, num_experts)
    sms = sm_count(x.device, off_gpu=2)  # the interpreter: two programs, so the persistent loop still strides
    act = torch.empty(t * top_k, intermediate, dtype=x.dtype, device=x.device)  # the activation
    launch1 = launch_gemm_ws if ws1 else launch_gemm
    launch1(
        x,
        GemmWeights(weights.w13_packed, weights.w13_scale, weights.w13_global),
        act,
        routing,
        config,
        epilogue1,
        is_gemm1=True,
        top_k=gather,
        sms=sms,
    )
    partial_dtype = x.dtype if config.partials_in_x_dtype else torch.float32  # the store casts the fp32 rows
    partial = torch.empty(t * top_k, hidden, dtype=partial_dtype, device=x.device)
    launch2 = launch_gemm_ws if ws2 else launch_gemm
    launch2(
        act,
        GemmWeights(weights.w2_packed, weights.w2_scale, weights.w2_global),
        partial,
        routing,
        config,
        epilogue2,
        is_gemm1=False,
        top_k=top_k,
        sms=sms,
    )
    combine(partial, topk_ids, expert_map, num_experts, out, None if apply_router_weight_on_input else topk_weights)
    return out


def batched_config(
    num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, gated: bool, expected_rows: float, device
) -> MoEKernelConfig:
    """The config of a batched forward whose busy experts hold about ``expected_rows`` rows each: the one
    select_config gives the same experts at the token count where a top-1 routing over them puts that many rows on
    each busy expert (LayerShape.tokens_up_to_rows), without pair tiles (each tile's expert comes from the counts,
    not from topk_ids)."""
    shape = LayerShape(num_experts, 1, hidden, intermediate, dtype, 0, gated)
    config = select_config(shape.tokens_up_to_rows(max(expected_rows, 1.0)), shape, device_traits(device))
    return dataclasses.replace(config, pair_tiles=False)


def fused_moe_batched_sm90(
    x: torch.Tensor,
    weights: MoEWeights,
    expert_num_tokens: torch.Tensor,
    out: torch.Tensor,
    config: MoEKernelConfig,
) -> None:
    """Host wrapper of the batched format (inputs checked by api.fused_moe_batched): x [E, M, H] with unit stride
    along H and rows M apart, expert_num_tokens int32 [E]; writes out[e, r] = FFN_e(x[e, r]) for r < count_e (the
    count clamped to [0, M]), unweighted, and nothing else.  Three launches: route_batched, then GEMM1 and GEMM2
    reading its tile map (each row its own pair, top-k 1; no combine: GEMM2's rows are the output).  No host
    synchronisation; every grid and buffer is sized from E, M, H and I."""
    e, m, hidden = x.shape
    intermediate = weights.intermediate
    if e * m == 0:
        return
    x_rows, out_rows = x.view(e * m, hidden), out.view(e * m, hidden)
    ws_ok = _gluon_rows_ok(x_rows, intermediate) and rows_16_aligned(out_rows)
    if x.is_cuda and not ws_ok and config.block_m < 16:  # 8-token tiles need both GEMMs Gluon (fused_moe_sm90)
        config = config.with_token_tile(16)
    sorted_rows, _, _, *tiles = route_batched(expert_num_tokens, m, config.block_m)
    # no tile is a pair tile: the ids go unread (a 16-byte aligned stand-in)
    stand_in = torch.empty(4, dtype=torch.int32, device=x.device)
    routing = GemmRouting((sorted_rows, *tiles), stand_in, None, False)
    sms = sm_count(x.device, off_gpu=2)
    act = torch.empty(e * m, intermediate, dtype=x.dtype, device=x.device)
    epilogue1 = Epilogue.of(weights.w13_bias, weights.activation)
    epilogue2 = Epilogue.of(weights.w2_bias, None)
    launch1 = launch_gemm_ws if config.gemm1.warp_specialized and ws_ok else launch_gemm
    launch1(
        x_rows,
        GemmWeights(weights.w13_packed, weights.w13_scale, weights.w13_global),
        act,
        routing,
        config,
        epilogue1,
        is_gemm1=True,
        top_k=1,
        sms=sms,
    )
    launch2 = launch_gemm_ws if config.gemm2.warp_specialized and ws_ok else launch_gemm
    launch2(
        act,
        GemmWeights(weights.w2_packed, weights.w2_scale, weights.w2_global),
        out_rows,
        routing,
        config,
        epilogue2,
        is_gemm1=False,
        top_k=1,
        sms=sms,
    )


def run_batched(
    out: torch.Tensor, x: torch.Tensor, weights: MoEWeights, expert_num_tokens: torch.Tensor, expected_rows: float
) -> None:
    """The ``moe_w4a16_batched`` entry: ``fused_moe_batched_sm90`` with ``batched_config``'s config for
    ``expected_rows``."""
    e, _, hidden = x.shape
    gated = weights.activation.gated
    config = batched_config(e, hidden, weights.intermediate, x.dtype, gated, expected_rows, x.device)
    fused_moe_batched_sm90(x, weights, expert_num_tokens, out, config)
