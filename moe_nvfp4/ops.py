"""torch.library custom ops with fake implementations, so torch.compile sees one opaque op, and their bodies
(``run_*``), which the API calls directly in eager mode (``api._through_op``)."""

from __future__ import annotations

import functools

import torch

from .dispatch import select_backends
from .expert_activation import ExpertActivation
from .layouts import rows_16_aligned
from .weight_layouts import weight_layout
from .weights import MoEWeights

__all__ = [
    "fused_moe_batched_op",
    "fused_moe_op",
    "fused_moe_w4a4_op",
    "run_fused_moe",
    "run_fused_moe_batched",
    "run_fused_moe_w4a4",
]


@functools.cache
def _expert_activation(name: str, alpha: float, limit: float) -> ExpertActivation:
    """The op's activation fields as the data they spell, validated once per distinct value (not every forward)."""
    return ExpertActivation(name, alpha, limit)


def _weights(
    tensors: list[torch.Tensor],
    hidden: int,
    intermediate: int,
    layout: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    alpha: float,
    limit: float,
) -> MoEWeights:
    """The op's weight arguments as the one ``MoEWeights`` the backends' entries take (checked again here: the op is
    callable without the API)."""
    return MoEWeights(
        *tensors,
        hidden=hidden,
        intermediate=intermediate,
        layout=weight_layout(layout),
        activation=_expert_activation(activation, alpha, limit),
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )


def _readable_rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x, or on a GPU a copy where its [rows, hidden] rows do not start on 16-byte boundaries (a column slice of a
    wider buffer): the Gluon GEMMs copy rows in 16-byte pieces, and such a view fell back to the Triton GEMM with the
    decode configs' 8-token tiles, which gave a relative error of 0.95 on an H200 (2026-11-28).  Checked here, in the
    op's body, because torch.compile cannot trace a data pointer (the API's checks run under it); the copy has a
    fixed shape, so it captures in a CUDA graph like the rest."""
    if x.is_cuda and not rows_16_aligned(x.reshape(-1, hidden)):
        return x.clone(memory_format=torch.contiguous_format)
    return x


@torch.library.custom_op("moe_nvfp4::fused_moe", mutates_args=())
def fused_moe_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    fp8_weights: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    hidden: int,
    intermediate: int,
    layout: str,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """weights: ``MoEWeights.tensors`` in the layout called ``layout``, the activation as
    expert_activation.ExpertActivation's fields; inputs already checked by api.fused_moe.  Runs the device's
    ``moe_w4a16`` backend (``Backend.entry``); with ``fp8_weights`` (``Fp8ExpertWeights.tensors`` folded from those
    weights; empty: none) its ``moe_w4a8`` entry (``run_fused_moe``)."""
    packed = _weights(weights, hidden, intermediate, layout, w13_bias, w2_bias, activation, alpha, limit)
    return run_fused_moe(x, packed, fp8_weights, topk_weights, topk_ids, expert_map, apply_router_weight_on_input)


def run_fused_moe(
    x: torch.Tensor,
    weights: MoEWeights,
    fp8_weights: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    apply_router_weight_on_input: bool,
) -> torch.Tensor:
    """fused_moe_op's body on checked inputs: the device's ``moe_w4a16`` backend (``Backend.entry``), or with
    ``fp8_weights`` (``Fp8ExpertWeights.tensors``; empty: none) its ``moe_w4a8`` entry, which picks W4A8 or W4A16
    (sm90.w4a8.fp8_pays: the rows an expert expects and, eagerly, the work; the token count is concrete here, under
    torch.compile too: the op's eager body)."""
    backend = select_backends(x.device).moe_w4a16
    x = _readable_rows(x, weights.hidden)
    if fp8_weights:
        run = backend.entry("moe_w4a8")
        return run(
            x,
            weights,
            fp8_weights,
            topk_weights,
            topk_ids,
            expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
    run = backend.entry("moe_w4a16")
    return run(
        x, weights, topk_weights, topk_ids, expert_map, apply_router_weight_on_input=apply_router_weight_on_input
    )


@fused_moe_op.register_fake
def _(
    x,
    weights,
    fp8_weights,
    topk_weights,
    topk_ids,
    expert_map,
    hidden,
    intermediate,
    layout,
    w13_bias=None,
    w2_bias=None,
    activation="silu",
    alpha=1.702,
    limit=7.0,
    apply_router_weight_on_input=False,
):
    return torch.empty_like(x)


@torch.library.custom_op("moe_nvfp4::fused_moe_batched", mutates_args=("out",))
def fused_moe_batched_op(
    out: torch.Tensor,
    x: torch.Tensor,
    weights: list[torch.Tensor],
    expert_num_tokens: torch.Tensor,
    hidden: int,
    intermediate: int,
    layout: str,
    expected_rows: float,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> None:
    """Writes the batched forward's rows into ``out`` [E, M, H] (api.fused_moe_batched checked the inputs) on the
    device's ``moe_w4a16`` backend (its ``moe_w4a16_batched`` entry; the sm_90 one picks the config for
    ``expected_rows``); weights as in ``fused_moe_op``.  The reference backend writes all of ``out`` (0 past each
    count); the kernels the counted rows only."""
    packed = _weights(weights, hidden, intermediate, layout, w13_bias, w2_bias, activation, alpha, limit)
    run_fused_moe_batched(out, x, packed, expert_num_tokens, expected_rows)


def run_fused_moe_batched(
    out: torch.Tensor, x: torch.Tensor, weights: MoEWeights, expert_num_tokens: torch.Tensor, expected_rows: float
) -> None:
    """fused_moe_batched_op's body on checked inputs."""
    run = select_backends(x.device).moe_w4a16.entry("moe_w4a16_batched")
    run(out, _readable_rows(x, weights.hidden), weights, expert_num_tokens, expected_rows)


@fused_moe_batched_op.register_fake
def _(
    out,
    x,
    weights,
    expert_num_tokens,
    hidden,
    intermediate,
    layout,
    expected_rows,
    w13_bias=None,
    w2_bias=None,
    activation="silu",
    alpha=1.702,
    limit=7.0,
):
    return None


@torch.library.custom_op("moe_nvfp4::fused_moe_w4a4", mutates_args=())
def fused_moe_w4a4_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    hidden: int,
    intermediate: int,
    layout: str,
    expert_offset: int,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """weights: ``MoEWeights.tensors`` in the layout called ``layout``; inputs already checked (the layout against
    the backend too) by api.fused_moe_w4a4.  Runs the device's W4A4 backend (``Backend.entry``)."""
    packed = MoEWeights(*weights, hidden=hidden, intermediate=intermediate, layout=weight_layout(layout, expert_offset))
    return run_fused_moe_w4a4(x, packed, topk_weights, topk_ids, expert_map, w13_input_scale, w2_input_scale)


def run_fused_moe_w4a4(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """fused_moe_w4a4_op's body on checked inputs."""
    run = select_backends(x.device).moe_w4a4.entry("moe_w4a4")
    scales = (w13_input_scale, w2_input_scale)
    return run(_readable_rows(x, weights.hidden), weights, topk_weights, topk_ids, expert_map, scales)


@fused_moe_w4a4_op.register_fake
def _(
    x,
    weights,
    topk_weights,
    topk_ids,
    expert_map,
    hidden,
    intermediate,
    layout,
    expert_offset,
    w13_input_scale,
    w2_input_scale,
):
    return torch.empty_like(x)
