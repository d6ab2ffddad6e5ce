"""Checkpoint tensors checked and packed once, at load, into the layout of the kernels that will read them:
``prepare_moe_weights`` (the 16-bit-activation MoE, the device's ``moe_w4a16`` backend's layout) and
``prepare_moe_weights_w4a4`` (the W4A4 MoE's).  ``api`` re-exports both."""

from __future__ import annotations

import torch

from .checkpoint import validate_nvfp4
from .dispatch import select_backends
from .expert_activation import SILU, ExpertActivation
from .formats import NVFP4, NVFP4Tensor
from .weight_layouts import MoELayout, weight_layout
from .weights import MoEWeights

__all__ = ["MAX_EXPERTS", "prepare_moe_weights", "prepare_moe_weights_w4a4"]

MAX_EXPERTS = 1024


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
    packer = backend.optional_entry("pack_block")
    pack_block = None if packer is None else packer(device, layout.fragments)
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
