"""Public API: pack expert weights once at load time, then run the fused NVFP4 MoE forward.

    weights = prepare_moe_weights(w13, w2)          # NVFP4Tensor [E, 2I, H] and [E, H, I]
    out = fused_moe(x, weights, topk_weights, topk_ids, expert_map=None)

Supported: x bf16 or fp16 [T, H] with any T >= 0; E up to 1024; top-k up to 16; H and I multiples of
16 (the layout pads rows to 64 and K to 128 at pack time; multiples of 128 avoid padded work); gate and up with
separate global scales; the expert activations of ``expert_activation`` (gated SiLU, gpt-oss's clamped SwiGLU,
non-gated ReLU^2), per-expert biases on both GEMMs, the router weight applied to the input.  Everything is
checked before any kernel launches.

This module holds the MoE forwards (and their warm-up and configs at load); the rest of the API lives by job in
``prepare_weights`` (packing at load), ``moe_inputs`` (a forward's inputs checked and cast once) and
``grouped_gemm`` (the W4A4 grouped GEMM), re-exported here.
"""

from __future__ import annotations

import torch

from . import backends
from .activations import _check_global_scale, quantize_activations
from .dispatch import select_backends
from .expert_activation import RELU2, SILU, SWIGLU_OAI, ExpertActivation
from .formats import input_scale_or_nan
from .grouped_gemm import grouped_gemm_nvfp4, launch_grouped_gemm_nvfp4, plan_grouped_gemm_nvfp4
from .moe_inputs import MAX_TOP_K, check_inputs, int32_saturated, kernel_inputs
from .prepare_weights import MAX_EXPERTS, prepare_moe_weights, prepare_moe_weights_w4a4
from .weights import Fp8ExpertWeights, MoEWeights

__all__ = [
    "MoEWeights",
    "prepare_moe_weights",
    "fused_moe",
    "prepare_fp8_weights",
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


def _check_w4a16_layout(weights: MoEWeights, op: str, remedy: str) -> None:
    """One weights type for every backend: the layout says which kernels read it, and only a layout some
    ``moe_w4a16`` backend reads (``Backend.w4a16_layout``) reaches one (a check of registry data, not of the device:
    no lookup in the forward that torch.compile traces)."""
    wanted = sorted({b.w4a16_layout for b in backends.REGISTRY if b.w4a16_layout})
    if weights.layout.name not in wanted:
        raise ValueError(f"weights are in the {weights.layout.name} layout; {op} reads {' or '.join(wanted)}: {remedy}")


def _through_op(x: torch.Tensor) -> bool:
    """Whether a forward must run as its torch.library custom op (ops.py): under a torch.compile or export trace, for
    a tensor subclass (fake, functional) or under a dispatch mode (make_fx), which must see one opaque op.  An eager
    call runs the op's body (``ops.run_*``) directly: the op's dispatch and the weights' re-validation were 210-270 us
    of host time a forward on an H200 host (design 008 decision 12), and vLLM already calls the method inside its
    own opaque ``moe_forward`` op."""
    return torch.compiler.is_compiling() or type(x) is not torch.Tensor or torch._C._len_torch_dispatch_stack() > 0


def fused_moe(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    fp8_weights: Fp8ExpertWeights | None = None,
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

    ``fp8_weights`` (``prepare_fp8_weights(weights)``, opt-in, about 1.8x the NVFP4 bytes): where each expert
    expects enough rows and, eagerly, the layer has enough work to hide the mode's host time (``sm90.w4a8.fp8_pays``:
    prefill-sized T) the activations are quantized per token to e4m3 and both GEMMs run on FP8 tensor cores (design
    008: about 6e-2 from the float64 reference against W4A16's 3e-3; 1.21-1.87x W4A16 at T = 1024-16384 where it
    runs, H200, benchmarks/results/w4a8/panel_zoo/); elsewhere the W4A16 forward runs as without them.
    """
    _check_w4a16_layout(weights, "fused_moe", "run fused_moe_w4a4, or pack with prepare_moe_weights")
    if fp8_weights is not None:
        _check_fp8_weights(weights, fp8_weights)
    check_inputs(x, weights.hidden, weights.num_experts, weights.w13_packed.device, topk_weights, topk_ids, expert_map)
    from .ops import fused_moe_op, run_fused_moe

    x, topk_weights, topk_ids, expert_map = kernel_inputs(x, topk_weights, topk_ids, expert_map)
    fp8_tensors = [] if fp8_weights is None else list(fp8_weights.tensors)
    if not _through_op(x):
        return run_fused_moe(
            x, weights, fp8_tensors, topk_weights, topk_ids, expert_map, bool(apply_router_weight_on_input)
        )
    act = weights.activation
    return fused_moe_op(
        x,
        list(weights.tensors),
        fp8_tensors,
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


def prepare_fp8_weights(weights: MoEWeights, nvfp4=None) -> Fp8ExpertWeights:
    """The W4A8 mode's e4m3 copy of ``weights`` for ``fused_moe(..., fp8_weights=...)`` (design 008): each value
    code x block scale x global scale folded per weight row to e4m3 (round to nearest even) with a power-of-two row
    scale; gate and up rows interleaved in blocks of 64.  ``nvfp4``: the (w13, w2) NVFP4Tensors ``weights`` were
    packed from, if at hand (spares unpacking the layout).  Made on ``weights``' device by its backend."""
    _check_w4a16_layout(weights, "prepare_fp8_weights", "pack with prepare_moe_weights")
    backend = select_backends(weights.w13_packed.device).moe_w4a16
    fold = backend.optional_entry("fold_fp8")
    if fold is None:
        raise ValueError(f"prepare_fp8_weights: the {backend.name} backend has no W4A8 mode (sm_90 and CPU have)")
    return fold(weights, nvfp4)


def _check_fp8_weights(weights: MoEWeights, fp8_weights: Fp8ExpertWeights) -> None:
    if fp8_weights.source is not weights:
        raise ValueError("fused_moe: fp8_weights were folded from other weights (prepare_fp8_weights(weights))")
    backend = select_backends(weights.w13_packed.device).moe_w4a16
    if "moe_w4a8" not in backend.entries:  # not optional_entry: it imports, which torch.compile cannot trace
        raise ValueError(f"fused_moe: fp8_weights given, but the {backend.name} backend has no W4A8 mode")


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
    from .ops import fused_moe_batched_op, run_fused_moe_batched

    if not x.is_contiguous():
        x = x.clone(memory_format=torch.contiguous_format)  # a view: the kernels read rows M * H apart
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    counts = int32_saturated(expert_num_tokens).contiguous()
    rows = float(x.shape[1] if expected_rows is None else expected_rows)
    if not _through_op(x):
        run_fused_moe_batched(out, x, weights, counts, rows)
        return out
    act = weights.activation
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
    check_inputs(x, weights.hidden, weights.num_experts, weights.w2_packed.device, topk_weights, topk_ids, expert_map)
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
    from .ops import fused_moe_w4a4_op, run_fused_moe_w4a4

    x, topk_weights, topk_ids, expert_map = kernel_inputs(x, topk_weights, topk_ids, expert_map)
    # Per-call scales: checked on the device (a bad one becomes NaN, so the output is NaN), not on the host,
    # which would synchronise every forward and break CUDA-graph capture.
    s13, s2 = (input_scale_or_nan(s.reshape(1)) for s in (w13_input_scale, w2_input_scale))
    if not _through_op(x):
        return run_fused_moe_w4a4(x, weights, topk_weights, topk_ids, expert_map, s13, s2)
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
    fp8_weights: Fp8ExpertWeights | None = None,
) -> list[int]:
    """Compile every kernel variant ``fused_moe`` can launch for 1..max_tokens tokens, now, not mid-serving.

    The kernels are compiled per tuned config (one per token-count range) and per routing variant;
    this runs one forward on zeros at the fewest tokens of each, in threads (``warmup.compile_kernels``;
    MOE_NVFP4_WARMUP_THREADS=1: serially).  Later calls with any T <= max_tokens, same weights (shape and
    variant), dtype, top_k, expert-map presence, ``apply_router_weight_on_input`` and ``fp8_weights`` (the W4A8
    mode's copy: its kernels too, from the fewest tokens where it runs), compile nothing.  Returns the token counts
    run (empty on CPU, where nothing is compiled).
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
        fp8_weights=fp8_weights,
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
    load = select_backends(weights.w13_packed.device).moe_w4a16.optional_entry("load_configs")
    return None if load is None else load(weights, top_k, dtype, max_tokens, expert_map=expert_map)
