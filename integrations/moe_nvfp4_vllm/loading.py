"""Loading a layer's expert tensors for ``NVFP4GroupedMoEMethod``: the parameters it creates (``ExpertParam``),
the wrapper around vLLM's weight loader that checks each tensor as it arrives and records it (``CheckedLoader``),
and the check of a whole layer once loaded (``validate_loaded_experts``: a one-sync screen of the stacked
parameters, then ``moe_nvfp4.validate.check_moe_layer`` for the findings where it flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moe_nvfp4.checkpoint import TENSOR_NAMES, CheckpointError, Convention
from moe_nvfp4.formats import NVFP4
from moe_nvfp4.validate import check_moe_layer, raise_first_error, stacked_layer_clean

__all__ = ["CheckedLoader", "ExpertParam", "LoadingMethod", "deinterleave_rows", "validate_loaded_experts"]

# Parameter kinds.
PACKED, BLOCK_SCALE, GLOBAL_SCALE, INPUT_SCALE, DENSE = "packed", "block_scale", "global_scale", "input_scale", "dense"
BIAS = "bias"
W13_SHARDS = ("w1", "w3")  # gate, up (vLLM's shard ids)
W13_NON_GATED = ("w1",)  # a non-gated layer's one w13 projection (Nemotron-H's up_proj) loads as shard w1


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` with gate/up rows interleaved (row 2i gate i, row 2i+1 up i: vLLM's swigluoai layout) ->
    gate rows then up rows (the layout ``prepare_moe_weights`` takes)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


@dataclass(frozen=True)
class ExpertParam:
    """One parameter this method creates: its name on the layer, kind, and which shards fill it."""

    name: str
    kind: str
    shards: tuple[str, ...]
    suffix: str  # the checkpoint tensor suffix, e.g. "weight_scale_2"


class LoadingMethod(Protocol):
    """What ``CheckedLoader`` reads of the MoE method it loads for (``NVFP4GroupedMoEMethod``)."""

    moe: Any  # vLLM's FusedMoEConfig of the layer
    loaded: set[tuple[str, int, str]]  # (parameter name, local expert, shard id) that arrived

    def proj_name(self, layer: torch.nn.Module, shard: str) -> str: ...


def validate_loaded_experts(
    layer_name: str,
    params: dict[str, torch.Tensor],
    loaded: set[tuple[str, int, str]],
    global_ids: list[int],
    convention: Convention,
    projections: tuple[str, str, str],
    *,
    require_input_scales: bool,
) -> bool:
    """Run ``moe_nvfp4.validate.check_moe_layer`` (the validator ``inspect`` and the converter use) on what was
    loaded; raise CheckpointError for its first error; return whether the layer has input scales.  A layer whose
    every tensor arrived is screened first on the stacked parameters (``stacked_layer_clean``: one host
    synchronisation); only a layer the screen flags goes through the per-expert validator for its findings.

    params: ``w13_<suffix>`` / ``w2_<suffix>`` -> [local E, ...] (w13 rows: gate then up; its scalars [E, 2]; a
    non-gated layer's w13 is its one projection, scalars [E, 1]); projections: the checkpoint's names of gate, up,
    down, or of w13 and down for a non-gated layer; loaded: (param name, local expert, shard id) that arrived;
    global_ids: local -> global expert id.
    """
    input_key = TENSOR_NAMES[convention][3]
    w13_shards = W13_SHARDS if len(projections) == 3 else W13_NON_GATED
    shards = {"w13": w13_shards, "w2": ("w2",)}
    input_params = {f"{prefix}_{input_key}" for prefix in shards}
    need_input = require_input_scales or any(name in input_params for name, _, _ in loaded)
    wanted = [name for name in params if need_input or name not in input_params]
    prefix_of = {name: name.split("_", 1)[0] for name in wanted}
    expected = (
        (name, local, shard) for name in wanted for local in range(len(global_ids)) for shard in shards[prefix_of[name]]
    )
    if all(key in loaded for key in expected):
        gemms = {
            p: {name.removeprefix(p + "_"): params[name] for name in wanted if prefix_of[name] == p} for p in shards
        }
        if stacked_layer_clean(gemms, convention=convention, need_input=need_input):
            return need_input  # every tensor present and every value check passed: the common case, one sync
    experts: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for local, g in enumerate(global_ids):
        for shard, proj in zip((*w13_shards, "w2"), projections):
            prefix = "w2" if shard == "w2" else "w13"
            for name, t in params.items():
                if not name.startswith(prefix + "_") or (name, local, shard) not in loaded:
                    continue
                t = t[local]
                if prefix == "w13":
                    part = w13_shards.index(shard)
                    t = t[part] if t.dim() == 1 else t.chunk(len(w13_shards), dim=0)[part]
                experts.setdefault(g, {}).setdefault(proj, {})[name.removeprefix(prefix + "_")] = t
    findings = check_moe_layer(
        layer_name,
        experts,
        convention=convention,
        expected_experts=global_ids,
        projections=projections,
        require_input_scales=require_input_scales,
    )
    raise_first_error(findings)
    return require_input_scales or any(input_key in t for ex in experts.values() for t in ex.values())


class CheckedLoader:
    """Wraps ``RoutedExperts.weight_loader`` for one parameter: dtype/shape checks, bookkeeping, input scales."""

    supports_moe_loading = True

    def __init__(self, method: LoadingMethod, layer: torch.nn.Module, param: ExpertParam, inner) -> None:
        self.method, self.param, self.inner = method, param, inner
        self.layer_name = getattr(layer, "layer_name", "moe")
        self._layer_ref = layer  # the loader lives on the layer's parameter; a plain reference is fine

    def _expected(self, shard: str) -> tuple[tuple[int, ...] | None, str]:
        """Full (unsharded) checkpoint shape of one expert's tensor, or None for a scalar; expected dtype."""
        moe = self.method.moe
        h, i = moe.hidden_dim_unpadded or moe.hidden_dim, moe.intermediate_size
        rows, cols = (h, i) if shard == "w2" else (i, h)
        kind = self.param.kind
        if kind == PACKED:
            return (rows, cols // 2), "torch.uint8"
        if kind == BLOCK_SCALE:
            return (rows, cols // NVFP4.block_size), "torch.float8_e4m3fn"
        if kind == DENSE:
            return (rows, cols), "floating point"
        return None, "floating point"

    def _check(self, w: torch.Tensor, shard: str, expert_id: int) -> None:
        want_shape, want_dtype = self._expected(shard)
        proj = self.method.proj_name(self._layer_ref, shard)
        where = f"{self.layer_name}: expert {expert_id} {proj}.{self.param.suffix}"
        kind = self.param.kind
        dtype_ok = {
            PACKED: w.dtype == torch.uint8,
            BLOCK_SCALE: w.dtype == NVFP4.scale_dtype,
        }.get(kind, w.dtype.is_floating_point)
        if not dtype_ok:
            raise CheckpointError(f"{where}: dtype {w.dtype}, expected {want_dtype}")
        if want_shape is None:
            if w.numel() != 1:
                raise CheckpointError(f"{where}: expected a scalar, got shape {tuple(w.shape)}")
        elif tuple(w.shape[-2:]) != want_shape:
            raise CheckpointError(
                f"{where}: shape {tuple(w.shape)}, expected {want_shape} (before tensor parallel slicing)"
            )

    def __call__(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        layer = self._layer_ref
        stacked = loaded_weight.dim() == 3 and self.param.kind in (PACKED, BLOCK_SCALE, DENSE)
        if shard_id not in self.param.shards:
            raise CheckpointError(
                f"{self.layer_name}: {weight_name} loaded as shard {shard_id}, expected {self.param.shards}"
            )
        self._check(loaded_weight, shard_id, expert_id)
        if stacked:
            ok = self.inner(param, loaded_weight, weight_name, shard_id, expert_id, return_success=True)
            locals_ = range(param.shape[0]) if ok else ()
        else:
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local == -1:
                return False if return_success else None
            if self.param.kind == INPUT_SCALE:
                target = param.data[local]
                if target.dim() == 1:
                    target = target[W13_SHARDS.index(shard_id)]
                target.copy_(loaded_weight.reshape(()).to(torch.float32))
                ok = True
            else:
                ok = self.inner(param, loaded_weight, weight_name, shard_id, expert_id, return_success=True)
            locals_ = (local,) if ok else ()
        for e in locals_:
            self.method.loaded.add((self.param.name, e, shard_id))
        return ok if return_success else None
