"""Public API: pack expert weights once at load time, then run the fused NVFP4 MoE forward.

    weights = prepare_moe_weights(w13, w2)          # NVFP4Tensor [E, 2I, H] and [E, H, I]
    out = fused_moe(x, weights, topk_weights, topk_ids, expert_map=None)

Supported: x bf16 or fp16 [T, H] with any T >= 0; E up to 1024; top-k up to 16; H and I multiples of
16 (the layout pads rows to 64 and K to 128 at pack time; multiples of 128 avoid padded work); gate and up with
separate global scales; the expert activations of ``expert_activation`` (gated SiLU, gpt-oss's clamped SwiGLU,
non-gated ReLU^2), per-expert biases on both GEMMs, the router weight applied to the input.  Everything is
checked before any kernel launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .activations import _check_global_scale, quantize_activations
from . import backends
from .checkpoint import validate_nvfp4
from .dispatch import select_backends
from .expert_activation import RELU2, SILU, SWIGLU_OAI, ExpertActivation
from .formats import NVFP4, NVFP4Tensor, ScaleLayout, input_scale_or_nan
from .layouts import padded_scale_shape, rows_16_aligned
from .weight_layouts import MoELayout, weight_layout
from .weights import MoEWeights

if TYPE_CHECKING:
    from .cute.host import GroupedW4A4Sm100Plan
    from .triton.grouped_w4a4 import GroupedW4A4Plan

__all__ = [
    "MoEWeights",
    "prepare_moe_weights",
    "fused_moe",
    "fused_moe_batched",
    "warmup_fused_moe",
    "load_moe_configs",
    "prepare_moe_weights_w4a4",
    "fused_moe_w4a4",
    "quantize_activations",
    "grouped_gemm_nvfp4",
    "plan_grouped_gemm_nvfp4",
    "launch_grouped_gemm_nvfp4",
    "MAX_EXPERTS",
    "MAX_TOP_K",
    "ExpertActivation",
    "SILU",
    "SWIGLU_OAI",
    "RELU2",
]

MAX_EXPERTS = 1024
MAX_TOP_K = 16


def _validated(w13: NVFP4Tensor, w2: NVFP4Tensor, gated: bool = True) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Shape and value checks shared by both weight layouts; returns both with linear scales and w13's
    global scale as [E, 2] (gate, up), or [E] where not ``gated`` (w13 then [E, I, H])."""
    for name, q in (("w13", w13), ("w2", w2)):
        if not isinstance(q, NVFP4Tensor):
            raise TypeError(f"{name} must be an NVFP4Tensor, got {type(q).__name__}")
        devices = {t.device for t in (q.packed, q.block_scale, q.global_scale)}
        if any(d.type == "meta" for d in devices):  # packing and the value checks read the values
            raise ValueError(
                f"{name} is on the meta device: prepare the weights from loaded tensors (after "
                "to_empty / load_state_dict)"
            )
        if devices != {w13.packed.device}:
            raise ValueError(
                f"w13 and w2 (packed, block scales, global scales) must be on one device, {name} has "
                f"{sorted(map(str, devices))}, w13.packed {w13.packed.device}"
            )
    if w13.packed.dim() != 3 or w2.packed.dim() != 3:
        raise ValueError(
            f"w13 and w2 must be stacked [E, N, K/2], got {tuple(w13.packed.shape)}, {tuple(w2.packed.shape)}"
        )
    e, n13, h = w13.packed.shape[0], w13.n, w13.k
    i = n13 // 2 if gated else n13
    if h < NVFP4.block_size or i < NVFP4.block_size:
        raise ValueError(
            f"hidden size H={h} and intermediate size I={i} (from w13 [E, {n13}, {h}]) must be positive "
            f"multiples of {NVFP4.block_size}"
        )
    rows = "2I" if gated else "I (non-gated activation)"
    if (gated and n13 % 2) or w2.packed.shape[0] != e or (w2.n, w2.k) != (h, i):
        raise ValueError(
            f"w13 [E={e}, {rows}={n13}, H={h}] and w2 [{w2.packed.shape[0]}, {w2.n}, {w2.k}] do not "
            "match (w2 must be [E, H, I])"
        )
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"{e} experts; supported 1..{MAX_EXPERTS}")
    validate_nvfp4(w13, name="w13")  # names the first bad expert
    validate_nvfp4(w2, name="w2")
    w13, w2 = w13.linear_scales(), w2.linear_scales()
    gs13 = w13.global_scale.float()
    if not gated:
        if gs13.shape != (e,):
            raise ValueError(f"w13 global scale must be [E] with a non-gated activation, got {tuple(gs13.shape)}")
        if w2.global_scale.shape != (e,):
            raise ValueError(f"w2 global scale must be [E], got {tuple(w2.global_scale.shape)}")
        return NVFP4Tensor(w13.packed, w13.block_scale, gs13.contiguous()), w2
    gs13 = gs13[:, None].expand(e, 2) if gs13.dim() == 1 else gs13
    if gs13.shape != (e, 2):
        raise ValueError(f"w13 global scale must be [E] or [E, 2], got {tuple(w13.global_scale.shape)}")
    if w2.global_scale.shape != (e,):
        raise ValueError(f"w2 global scale must be [E], got {tuple(w2.global_scale.shape)}")
    return NVFP4Tensor(w13.packed, w13.block_scale, gs13.contiguous()), w2


def _bias(bias: torch.Tensor | None, name: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """A bias argument checked (floating point, ``shape``, finite: the first bad expert named) and stored as the
    kernels read it: float32, contiguous, on the weights' device."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {getattr(bias, 'dtype', type(bias))}")
    if tuple(bias.shape) != shape:
        raise ValueError(f"{name} must be [{', '.join(map(str, shape))}], got {tuple(bias.shape)}")
    bias = bias.to(device=device, dtype=torch.float32).contiguous()
    bad = ~torch.isfinite(bias).all(dim=1)
    if bad.any():
        raise ValueError(f"{name} has non-finite values (expert {int(bad.nonzero()[0, 0])})")
    return bias


def prepare_moe_weights(
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    *,
    activation: ExpertActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    reuse_input_memory: bool = False,
) -> MoEWeights:
    """Validate and pack checkpoint tensors for the kernel, a run of experts a launch (on the GPU by a Triton kernel).

    w13: [E, 2I, H] (gate rows then up rows; global scale [E] or [E, 2]), or [E, I, H] (global [E]) when
    ``activation`` is not gated; w2: [E, H, I] (global [E]).  Biases, any float dtype: w13_bias [E, 2I] (gate
    then up; [E, I] non-gated), w2_bias [E, H]; stored float32.  The result lives on the inputs' device.
    ``reuse_input_memory``: pack each of w13 and w2 that its layout does not pad (rows, gate and up apart, a
    multiple of 64; K of 128) into its own memory, overwriting it, so the peak extra memory is one run of experts'
    blocks (``weight_layouts.PACK_RUN_BYTES``, 16 MiB, or one expert's block where larger) instead of the packed
    layer (vLLM's method passes True: it drops the checkpoint tensors once packed).
    """
    if not isinstance(activation, ExpertActivation):
        raise TypeError(f"activation must be an ExpertActivation (expert_activation.SILU, ...), got {activation!r}")
    w13, w2 = _validated(w13, w2, activation.gated)
    e, h, device = w13.packed.shape[0], w13.k, w13.packed.device
    backend = select_backends(device).moe_w4a16  # the weights are packed once, for the kernels of their device
    layout = weight_layout(backend.w4a16_layout)
    pack_block = backend.entry("pack_block")(device, layout.fragments) if "pack_block" in backend.entries else None
    tensors = layout.pack(w13, w2, reuse_input_memory=reuse_input_memory, pack_block=pack_block)
    return MoEWeights(
        *tensors,
        hidden=h,
        intermediate=w2.k,
        layout=layout,
        activation=activation,
        w13_bias=_bias(w13_bias, "w13_bias", (e, w13.n), device),
        w2_bias=_bias(w2_bias, "w2_bias", (e, h), device),
    )


def _packed(w13: NVFP4Tensor, w2: NVFP4Tensor, layout: MoELayout) -> MoEWeights:
    """Checkpoint tensors of a gated SiLU MoE without biases validated, then packed into ``layout``."""
    w13, w2 = _validated(w13, w2)
    return MoEWeights(*layout.pack(w13, w2), hidden=w13.k, intermediate=w2.k, layout=layout)


def _check_inputs(
    x: torch.Tensor,
    hidden: int,
    num_experts: int,
    weights_device: torch.device,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> None:
    """Metadata checks only (no host synchronisation): the values of topk_ids and expert_map are never read here.
    Ids outside [0, E_global) and map entries outside [0, E) are not errors: they route the pair nowhere
    (routing.routed_pairs), masked in the kernels, so a corrupt id costs its pair, never memory safety."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or not 1 <= topk_ids.shape[1] <= MAX_TOP_K:
        raise ValueError(f"topk_ids must be [T={x.shape[0]}, k<={MAX_TOP_K}], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    devices = {t.device for t in (x, topk_weights, topk_ids)} | {weights_device}
    if len(devices) != 1:
        raise ValueError(f"x, weights and routing tensors must be on one device, got {devices}")
    if expert_map is None:
        return
    if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"expert_map must be a 1-D int32 or int64 tensor, got {expert_map.dtype} {tuple(expert_map.shape)}"
        )
    if expert_map.device != topk_ids.device:
        raise ValueError(
            f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}: they must share a device"
        )
    # Its length is the global expert count the ids index: one entry per global expert, so at least the local ones.
    if expert_map.numel() < num_experts:
        raise ValueError(
            f"expert_map has {expert_map.numel()} entries but the weights hold {num_experts} local "
            "experts: it needs one entry per global expert (the ids' range)"
        )


def _check_w4a16_layout(weights: MoEWeights, op: str, remedy: str) -> None:
    """One weights type for every backend: the layout says which kernels read it, and only a layout some
    ``moe_w4a16`` backend reads (``Backend.w4a16_layout``) reaches one (a check of registry data, not of the device:
    no lookup in the forward that torch.compile traces)."""
    wanted = sorted({b.w4a16_layout for b in backends.REGISTRY if b.w4a16_layout})
    if weights.layout.name not in wanted:
        raise ValueError(f"weights are in the {weights.layout.name} layout; {op} reads {' or '.join(wanted)}: {remedy}")


def _kernel_inputs(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """What the kernels read, checked inputs in their forms: x with unit stride along H and, on a GPU, rows the
    Gluon GEMMs can read (layouts.rows_16_aligned), topk_weights float32, topk_ids int32, expert_map contiguous int32.
    A strided x (``x[:, ::2]``) or one whose rows start off 16-byte boundaries (a column slice of a wider buffer) is
    a valid tensor, so it is copied, not refused: the Gluon GEMMs every decode config names copy rows in 16-byte
    pieces, and such a view fell back to the Triton GEMM with those configs' 8-token tiles, which the property test
    caught giving a relative error of 0.95 on an H200 (a [1, 16] fp16 slice of a [1, 19] buffer, 2026-11-28).  The
    copy of [T, H] costs little beside the expert weights every forward streams; it has a fixed shape, so it
    captures in a CUDA graph like the rest.  int64 ids and entries past int32 saturate (to -1 or int32's max, both
    out of range) instead of wrapping onto a valid expert.  topk_weights and topk_ids are made contiguous (once,
    after the cast, which copies anyway when it converts): the kernels index them by flat pair t * k + j, so a
    strided view (``ids[:, :1]``, every other row, a column slice of a wider buffer) would be read as other
    pairs' values; the copy is [T, k], fixed-size, graph-capturable."""
    if x.stride(-1) != 1 or (x.is_cuda and not rows_16_aligned(x)):
        x = x.clone(memory_format=torch.contiguous_format)  # .contiguous() keeps a one-row view's row stride
    emap = None if expert_map is None else _int32_saturated(expert_map).contiguous()
    return x, topk_weights.float().contiguous(), _int32_saturated(topk_ids).contiguous(), emap


def _int32_saturated(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.clamp(-1, 2**31 - 1).to(torch.int32)


def fused_moe(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """NVFP4 MoE forward: sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t]) -> [T, H] in x.dtype, FFN_e(x) =
    W2_e act(W13_e x + b13_e) + b2_e with the weights' activation and biases (``prepare_moe_weights``).

    With ``apply_router_weight_on_input`` (Llama-4's top-1 routing; any top-k works) the sum is
    sum_j FFN_e(x[t] * topk_weights[t, j]), the product rounded to x.dtype as vLLM rounds it.
    topk_ids are global expert ids; with ``expert_map`` (int32 [E_global], -1 = not on this rank) only
    local experts contribute.  A pair whose id is outside [0, E_global) (E_global = E without a map) or whose
    map entry is outside [0, E) contributes nothing (``routing.routed_pairs``).  No host synchronisation:
    capturable in a CUDA graph.  On CUDA this runs the Triton kernels (one launch per GEMM over all
    experts); on CPU the torch reference.  The kernels are the device's ``moe_w4a16`` backend's (backends.py).
    """
    _check_w4a16_layout(weights, "fused_moe", "run fused_moe_w4a4, or pack with prepare_moe_weights")
    _check_inputs(x, weights.hidden, weights.num_experts, weights.w13_packed.device, topk_weights, topk_ids, expert_map)
    from .ops import fused_moe_op

    x, topk_weights, topk_ids, expert_map = _kernel_inputs(x, topk_weights, topk_ids, expert_map)
    act = weights.activation
    return fused_moe_op(
        x,
        list(weights.tensors),
        topk_weights,
        topk_ids,
        expert_map,
        weights.hidden,
        weights.intermediate,
        weights.layout.name,
        weights.w13_bias,
        weights.w2_bias,
        act.name,
        act.alpha,
        act.limit,
        bool(apply_router_weight_on_input),
    )


def fused_moe_batched(
    x: torch.Tensor,
    weights: MoEWeights,
    expert_num_tokens: torch.Tensor,
    *,
    expected_rows: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts on vLLM's batched activation format (what DeepEP low-latency dispatch hands the experts):
    x [E, M, H] bf16 or fp16 holds local expert e's tokens in its first ``expert_num_tokens[e]`` rows (int32 or int64
    [E], on x's device); returns [E, M, H] in x.dtype (``out`` where given) with out[e, r] = FFN_e(x[e, r]) for
    r < count_e, the weights' activation and biases, unweighted: vLLM's finalize or combine applies the top-k weights
    and sums.  Rows past an expert's count are not written (the reference backend writes 0 there).

    Counts are read on the device, clamped to [0, M]: no host synchronisation, so the forward captures in a CUDA
    graph; the kernels read x's rows and the counts where they are (no repack).  ``expected_rows``: about how many
    rows a busy expert holds this step (e.g. ``LayerShape.rows_per_active_expert`` of the step's tokens), which picks
    the kernel config (``sm90.host.batched_config`` on sm_90); None: M, every row in use.  The semantics of
    ``reference.fused_moe_batched_torch``.
    """
    _check_w4a16_layout(weights, "fused_moe_batched", "pack them with prepare_moe_weights")
    e, hidden = weights.num_experts, weights.hidden
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be a bfloat16 or float16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 3 or x.shape[0] != e or x.shape[2] != hidden:
        raise ValueError(f"x must be [E={e}, max_tokens, H={hidden}] (the batched format), got {tuple(x.shape)}")
    if not isinstance(expert_num_tokens, torch.Tensor) or expert_num_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"expert_num_tokens must be an int32 or int64 tensor, got "
            f"{getattr(expert_num_tokens, 'dtype', type(expert_num_tokens).__name__)}"
        )
    if tuple(expert_num_tokens.shape) != (e,):
        raise ValueError(
            f"expert_num_tokens must be [E={e}] (one count per local expert), got {tuple(expert_num_tokens.shape)}"
        )
    devices = {x.device, expert_num_tokens.device, weights.w13_packed.device}
    if len(devices) != 1:
        raise ValueError(f"x, expert_num_tokens and the weights must be on one device, got {sorted(map(str, devices))}")
    if expected_rows is not None and not (isinstance(expected_rows, (int, float)) and expected_rows > 0):
        raise ValueError(f"expected_rows must be a positive number or None, got {expected_rows!r}")
    if out is not None and (
        not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
    ):
        raise ValueError(
            f"out must be a {x.dtype} tensor {tuple(x.shape)} on {x.device} like x, got "
            f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}"
        )
    if out is not None and not out.is_contiguous():
        raise ValueError(f"out must be contiguous (the kernel writes its rows M * H apart), got strides {out.stride()}")
    from .ops import fused_moe_batched_op

    if not x.is_contiguous() or (x.is_cuda and not rows_16_aligned(x.view(-1, hidden))):
        x = x.clone(memory_format=torch.contiguous_format)  # a view: the kernels read rows M * H apart
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    counts = _int32_saturated(expert_num_tokens).contiguous()
    act = weights.activation
    rows = float(x.shape[1] if expected_rows is None else expected_rows)
    fused_moe_batched_op(
        out,
        x,
        list(weights.tensors),
        counts,
        weights.hidden,
        weights.intermediate,
        weights.layout.name,
        rows,
        weights.w13_bias,
        weights.w2_bias,
        act.name,
        act.alpha,
        act.limit,
    )
    return out


def prepare_moe_weights_w4a4(w13: NVFP4Tensor, w2: NVFP4Tensor, *, expert_offset: int = 0) -> MoEWeights:
    """Validate checkpoint tensors (as ``prepare_moe_weights``) and pack them in the layout the W4A4 MoE backend of
    their device reads (``dispatch.select_backends``, ``Backend.w4a4_layout``), chosen here once: FlashInfer's
    fused MoE on sm_100/sm_103 (``flashinfer_trtllm``), else our kernels' (``sm100_interleaved``: K-major packed
    values, 128x4-swizzled scales, gate and up rows interleaved in blocks of 32; H a multiple of 32); see
    ``weight_layouts``.  ``expert_offset``: the global id of local expert 0 under expert parallelism (the
    FlashInfer kernel takes the local experts as one contiguous range; the others are routed by the expert map)."""
    backend = select_backends(w13.packed.device).moe_w4a4
    if backend is None:
        raise ValueError(
            f"the W4A4 MoE needs block-scaled FP4 tensor cores (sm_100/sm_103); {w13.packed.device} has "
            "none: use prepare_moe_weights (16-bit activations)"
        )
    return _packed(w13, w2, weight_layout(backend.w4a4_layout, expert_offset))


def fused_moe_w4a4(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_input_scale: torch.Tensor,
    w2_input_scale: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A4 NVFP4 MoE forward: ``fused_moe`` with the activations entering each GEMM quantized to NVFP4 with a
    fixed global scale (one float32 value each: ModelOpt's ``input_scale``, a multiplier), the semantics of
    ``fused_moe_torch(..., w13_input_scale=, w2_input_scale=)``.  A scale that is NaN, inf, <= 0 or outside
    ``formats.INPUT_SCALE_RANGE`` gives NaN output (``input_scale_or_nan``); so does a token holding NaN or inf,
    as with ``fused_moe`` (``quantize_activations``).

    The kernels are those ``prepare_moe_weights_w4a4`` laid the weights out for: on sm_100/sm_103 FlashInfer's
    NVFP4 fused MoE by default, our CuTe DSL kernels with MOE_NVFP4_BACKEND=cute (compiled and checked, not yet
    run on hardware); CPU: the reference.  Other GPUs have no FP4 tensor cores: run ``fused_moe`` there
    (activations stay 16-bit).
    """
    _check_inputs(x, weights.hidden, weights.num_experts, weights.w2_packed.device, topk_weights, topk_ids, expert_map)
    _check_global_scale("w13_input_scale", w13_input_scale, x.device)
    _check_global_scale("w2_input_scale", w2_input_scale, x.device)
    backend = select_backends(x.device).moe_w4a4
    if backend is None:
        raise ValueError(
            f"the W4A4 MoE needs block-scaled FP4 tensor cores (sm_100/sm_103); {x.device} has none: "
            "use fused_moe (16-bit activations)"
        )
    layout = weights.layout
    if not (backend.reference or layout.name == backend.w4a4_layout):
        raise ValueError(
            f"weights are in the {layout.name} layout, but {x.device} runs the W4A4 MoE on {backend.name}, "
            f"which reads {backend.w4a4_layout}: prepare them with prepare_moe_weights_w4a4 here"
        )
    global_experts = weights.num_experts if expert_map is None else expert_map.numel()
    if layout.expert_offset + weights.num_experts > global_experts:
        raise ValueError(
            f"experts {layout.expert_offset}..{layout.expert_offset + weights.num_experts - 1} "
            f"are local, but expert_map has only {global_experts} entries"
        )
    from .ops import fused_moe_w4a4_op

    x, topk_weights, topk_ids, expert_map = _kernel_inputs(x, topk_weights, topk_ids, expert_map)
    # Per-call scales: checked on the device (a bad one becomes NaN, so the output is NaN), not on the host,
    # which would synchronise every forward and break CUDA-graph capture.
    s13, s2 = (input_scale_or_nan(s.reshape(1)) for s in (w13_input_scale, w2_input_scale))
    return fused_moe_w4a4_op(
        x,
        list(weights.tensors),
        topk_weights,
        topk_ids,
        expert_map,
        weights.hidden,
        weights.intermediate,
        layout.name,
        layout.expert_offset,
        s13,
        s2,
    )


def warmup_fused_moe(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
) -> list[int]:
    """Compile every kernel variant ``fused_moe`` can launch for 1..max_tokens tokens, now, not mid-serving.

    The kernels are compiled per tuned config (one per token-count range) and per routing variant;
    this runs one forward on zeros at the fewest tokens of each, in threads (``warmup.compile_kernels``;
    MOE_NVFP4_WARMUP_THREADS=1: serially).  Later calls with any T <= max_tokens, same weights (shape and
    variant), dtype, top_k, expert-map presence and ``apply_router_weight_on_input``, compile nothing.  Returns
    the token counts run (empty on CPU, where nothing is compiled).
    """
    from .warmup import compile_kernels

    return compile_kernels(
        weights,
        top_k,
        dtype,
        max_tokens,
        forward=fused_moe,
        expert_map=expert_map,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )


def load_moe_configs(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    expert_map: torch.Tensor | None = None,
):
    """What a serving engine runs at load, once per layer shape, before ``warmup_fused_moe``: the kernel configs of
    the weights' ``moe_w4a16`` backend for this shape (its ``load_configs`` entry; on sm_90 the configs `moe-nvfp4
    tune` cached for this GPU and shape, else the default, and with MOE_NVFP4_AUTOTUNE=1 timed here first).
    Returns the backend's report (``summary()`` says what serves, ``source`` where it came from: "cpu" where
    nothing is chosen), or None where the backend chooses nothing at load (the CPU's torch reference)."""
    backend = select_backends(weights.w13_packed.device).moe_w4a16
    if "load_configs" not in backend.entries:
        return None
    return backend.entry("load_configs")(weights, top_k, dtype, max_tokens, expert_map=expert_map)


def grouped_gemm_nvfp4(
    a: Sequence[NVFP4Tensor],
    b: Sequence[NVFP4Tensor],
    *,
    alpha: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    """W4A4 NVFP4 grouped GEMM: per group g, ``alpha[g] * A_g @ B_g^T`` -> out_dtype [M_g, N_g], where A_g
    [M_g, K_g] and B_g [N_g, K_g] are NVFP4 (packed e2m1, e4m3 block scales in either layout, one global
    scale each) and alpha float32 [G] is optional.  The semantics of ``reference.grouped_gemm_nvfp4_torch``.

    One persistent launch over all groups, by device (``dispatch.select_backends``): Hopper and other CUDA GPUs run
    the Triton kernel (both operands decoded in registers, exact; fp32 accumulation); sm_100/sm_103 run the
    CuTe DSL kernel (block-scaled tcgen05 MMA; compiled and checked, not yet run on hardware); CPU runs the
    reference.  Each call plans on the host (pointer arrays, group sizes); to capture the launch in a CUDA
    graph, plan once with ``plan_grouped_gemm_nvfp4`` and launch the plan.
    """
    _check_grouped(a, b, alpha, out_dtype)
    return select_backends(a[0].packed.device).grouped_gemm.entry("grouped_gemm")(
        a, b, alpha=alpha, out_dtype=out_dtype
    )


def plan_grouped_gemm_nvfp4(
    a: Sequence[NVFP4Tensor],
    b: Sequence[NVFP4Tensor],
    *,
    alpha: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> GroupedW4A4Plan | GroupedW4A4Sm100Plan:
    """Checked inputs -> a plan for ``launch_grouped_gemm_nvfp4`` (CUDA; the backend's plan type): outputs
    allocated, operands with swizzled scales held, pointer arrays and group sizes on the device.  Launching
    the plan allocates and copies nothing, so it can be captured in a CUDA graph."""
    _check_grouped(a, b, alpha, out_dtype)
    planner = select_backends(a[0].packed.device).grouped_gemm.entry("plan_grouped_gemm")
    return planner(a, b, alpha=alpha, out_dtype=out_dtype)


def launch_grouped_gemm_nvfp4(plan: GroupedW4A4Plan | GroupedW4A4Sm100Plan) -> list[torch.Tensor]:
    """Run a plan: one kernel launch, no allocation or copy (capturable); returns the plan's outputs."""
    from .cute.host import GroupedW4A4Sm100Plan, launch_grouped_w4a4_sm100  # no cutlass import until a launch

    if isinstance(plan, GroupedW4A4Sm100Plan):
        return launch_grouped_w4a4_sm100(plan)
    from .triton.grouped_w4a4 import launch_grouped_w4a4

    return launch_grouped_w4a4(plan)


def _check_grouped(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], alpha: torch.Tensor | None, out_dtype: torch.dtype
) -> None:
    if not a or len(a) != len(b):
        raise ValueError(f"need one B per A and at least one group, got {len(a)} A and {len(b)} B groups")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float16 or bfloat16, got {out_dtype}")
    device = a[0].packed.device
    for g, (ag, bg) in enumerate(zip(a, b)):
        for name, t in (("A", ag), ("B", bg)):
            if t.packed.dim() != 2 or t.packed.dtype != torch.uint8:
                raise ValueError(
                    f"group {g}: {name} must be one packed uint8 [rows, K/2] matrix, got "
                    f"{t.packed.dtype} {tuple(t.packed.shape)}"
                )
            if t.block_scale.dtype != NVFP4.scale_dtype:  # a float32 / bf16 / uint8 view would be read as e4m3 bytes
                raise TypeError(
                    f"group {g}: {name}.block_scale must be {NVFP4.scale_dtype} (e4m3 block scales), got "
                    f"{t.block_scale.dtype}"
                )
            if t.global_scale.numel() != 1:
                raise ValueError(f"group {g}: {name} needs one global scale, got shape {tuple(t.global_scale.shape)}")
            if {t.packed.device, t.block_scale.device, t.global_scale.device} != {device}:
                raise ValueError(f"group {g}: {name} is not entirely on {device}")
        if ag.k != bg.k or ag.k % NVFP4.block_size:
            raise ValueError(f"group {g}: A has K={ag.k}, B has K={bg.k}; they must agree and be multiples of 16")
        for name, t in (("A", ag), ("B", bg)):  # a smaller scale tensor would leave rows scaled by its padding
            rows, cols = t.n, t.k // NVFP4.block_size
            want = (rows, cols) if t.scale_layout is ScaleLayout.LINEAR else padded_scale_shape(rows, cols)
            if tuple(t.block_scale.shape) != want:
                raise ValueError(
                    f"group {g}: {name}.block_scale ({t.scale_layout.value}) must be {want} for a "
                    f"[{rows}, {t.k}] operand, got {tuple(t.block_scale.shape)}"
                )
    if alpha is not None and (alpha.shape != (len(a),) or alpha.dtype != torch.float32 or alpha.device != device):
        raise ValueError(
            f"alpha must be float32 [{len(a)}] on {device}, got {alpha.dtype} {tuple(alpha.shape)} on {alpha.device}"
        )
    _check_grouped_scale_values(a, b)


def _check_grouped_scale_values(a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor]) -> None:
    """Global scales finite and positive, block scales neither NaN nor negative (the Triton kernel reads their
    magnitude bits only: NaN as 480, -s as s).  Values, so one host synchronisation; both entries that call this
    plan on the host anyway (a plan's launch, the graph-capturable part, checks nothing)."""
    operands = [(g, name, t) for g, pair in enumerate(zip(a, b)) for name, t in zip("AB", pair)]

    def bad(t: NVFP4Tensor) -> torch.Tensor:
        gs = t.global_scale.float()
        scale_bits = t.linear_scales().block_scale.view(torch.uint8)  # real scales only, not the swizzle padding
        bad_block = ((scale_bits & 0x7F) == 0x7F) | (scale_bits > 0x80)  # NaN, or negative and non-zero
        return torch.stack(((~torch.isfinite(gs) | (gs <= 0)).any(), bad_block.any()))

    flags = torch.stack([bad(t) for _, _, t in operands]).cpu()
    if bool(flags.any()):
        i, what = (int(v) for v in flags.nonzero()[0])
        g, name, t = operands[i]
        if what == 0:
            raise ValueError(
                f"group {g}: {name}.global_scale must be finite and positive, got "
                f"{t.global_scale.float().reshape(-1).tolist()}"
            )
        raise ValueError(f"group {g}: {name}.block_scale holds NaN or negative e4m3 scales")
