"""``NVFP4GroupedConfig``: vLLM ``QuantizationConfig`` for ``--quantization nvfp4_grouped``.

What a checkpoint declares decides where its tensors come from; MoE experts always go to our method:

============================  ===========================================  =================================
checkpoint                    routed experts                               other layers
============================  ===========================================  =================================
ModelOpt NVFP4 (config.json   NVFP4GroupedMoEMethod, ModelOpt names        ModelOptNvFp4Config's methods
or hf_quant_config.json;      (weight, weight_scale, weight_scale_2,       (NVFP4 linear, unquantized for
our converter's default)      input_scale)                                 excluded layers, KV cache)
compressed-tensors            NVFP4GroupedMoEMethod, CT names              CompressedTensorsConfig's methods
nvfp4-pack-quantized          (weight_packed, weight_global_scale, ...)
BF16 (no quantization_config) BF16 parameters quantized on load            UnquantizedLinearMethod
============================  ===========================================  =================================

A malformed quantization config (a list, ``config_groups`` as a list, a group without ``targets``, ``group_size``
"16.0", an invalid ``re:`` pattern, ...) is refused by ``from_config`` with ``QuantConfigError`` (a ValueError)
naming the field, before vLLM's own parsers see it (``moe_nvfp4.convert.quant_config.check_quantization_config``).
"""

from __future__ import annotations

import os

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from moe_nvfp4.checkpoint import Convention
from moe_nvfp4.convert.quant_config import QuantConfigError, check_quantization_config

from . import compat
from .names import QUANTIZATION_NAME

__all__ = ["NVFP4GroupedConfig", "QuantConfigError", "is_modelopt_nvfp4", "is_compressed_tensors_nvfp4"]

_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
_CT_FORMAT = "nvfp4-pack-quantized"


def _modelopt_algo(cfg: dict[str, Any]) -> str | None:
    """quant_algo (upper case) of a ModelOpt config in either form, or None when ``cfg`` is not ModelOpt."""
    method = str(cfg.get("quant_method", "")).lower()
    producer = (cfg.get("producer") or {}).get("name") if isinstance(cfg.get("producer"), dict) else None
    nested = cfg.get("quantization")
    if not (method.startswith("modelopt") or method == QUANTIZATION_NAME or producer == "modelopt"):
        return None
    algo = (nested if isinstance(nested, dict) else cfg).get("quant_algo")
    return None if algo is None else str(algo).upper()


def is_modelopt_nvfp4(cfg: dict[str, Any] | None) -> bool:
    """A ModelOpt config (flat config.json form or nested hf_quant_config.json form) with an NVFP4 algo."""
    return isinstance(cfg, dict) and bool(cfg) and _modelopt_algo(cfg) in _MODELOPT_ALGOS


def _ct_nvfp4_weights(args: Any) -> bool:
    return (
        isinstance(args, dict)
        and args.get("num_bits") == 4
        and args.get("type") == "float"
        and args.get("group_size") == 16
        and args.get("strategy") == "tensor_group"
    )


def is_compressed_tensors_nvfp4(cfg: dict[str, Any] | None) -> bool:
    """compressed-tensors with at least one NVFP4 (nvfp4-pack-quantized) config group."""
    if not isinstance(cfg, dict) or str(cfg.get("quant_method", "")).lower().replace("_", "-") != "compressed-tensors":
        return False
    groups = cfg.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict)
        and (g.get("format", cfg.get("format")) == _CT_FORMAT or _ct_nvfp4_weights(g.get("weights")))
        for g in groups.values()
    )


def _ct_w4a4(cfg: dict[str, Any]) -> bool:
    groups = cfg.get("config_groups") or {}
    return any(isinstance(g, dict) and g.get("input_activations") for g in groups.values())


FP8_ACTIVATIONS_ENV = "MOE_NVFP4_FP8_ACTIVATIONS"  # 1: the W4A8 mode on, 0: off, whatever the checkpoint says
FP8_ACTIVATIONS_KEY = "fp8_activations"  # the quantization config's switch (true / false)


def fp8_activations_wanted(from_config: bool) -> bool:
    """The W4A8 mode's switch: FP8_ACTIVATIONS_ENV where set (1 or 0, anything else refused by name), else the
    quantization config's FP8_ACTIVATIONS_KEY."""
    value = os.environ.get(FP8_ACTIVATIONS_ENV)
    if value is None or value == "":
        return from_config
    if value not in ("0", "1"):
        raise ValueError(f"{FP8_ACTIVATIONS_ENV}={value!r}: expected 1 (the W4A8 mode on) or 0 (off)")
    return value == "1"


class NVFP4GroupedConfig(QuantizationConfig):
    """Routes routed experts to ``NVFP4GroupedMoEMethod`` and every other layer to vLLM's own method.

    convention: ``Convention.MODELOPT`` / ``Convention.COMPRESSED_TENSORS`` for an NVFP4 checkpoint (tensor
    names of that convention), None for a BF16 checkpoint quantized on load.  ``delegate`` is vLLM's config
    for the same checkpoint (non-expert layers, KV cache); ``input_scales`` says whether the checkpoint is
    W4A4 and so must carry expert input scales.  ``NVFP4GroupedConfig()`` is the BF16 form: vLLM constructs it
    with no arguments when the checkpoint has no quantization config.  Every construction checks that this vLLM
    is a supported release (``compat.check_supported``).
    """

    def __init__(
        self,
        convention: Convention | None = None,
        *,
        delegate: QuantizationConfig | None = None,
        input_scales: bool = False,
        fp8_activations: bool = False,
    ) -> None:
        compat.check_supported()
        super().__init__()
        if convention is not None and delegate is None:
            raise ValueError("NVFP4GroupedConfig: an NVFP4 checkpoint convention needs vLLM's config as delegate")
        self.convention = convention
        self.delegate = delegate
        self.input_scales = input_scales
        # the W4A8 mode (design 008): an e4m3 copy of the experts, about 1.8x their NVFP4 bytes, for prefill-sized
        # forwards; opt-in through the checkpoint's quantization config or FP8_ACTIVATIONS_ENV, which wins
        self.fp8_activations = fp8_activations_wanted(fp8_activations)

    def __repr__(self) -> str:
        conv = self.convention.value if self.convention else "bf16 (quantized on load)"
        return (
            f"NVFP4GroupedConfig(convention={conv}, input_scales={self.input_scales}, "
            f"fp8_activations={self.fp8_activations})"
        )

    # ---- what vLLM asks of every QuantizationConfig ----

    def get_name(self) -> str:
        return QUANTIZATION_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # the Triton kernel targets Hopper (sm_90) and newer

    @staticmethod
    def get_config_filenames() -> list[str]:
        # vLLM reads hf_quant_config.json into hf_config.quantization_config itself; with no config at all
        # it calls NVFP4GroupedConfig() (BF16 quantized on load) because this list is empty.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NVFP4GroupedConfig":
        """Build from the checkpoint's quantization config (ModelOpt NVFP4, compressed-tensors NVFP4, or empty).

        QuantConfigError (a ValueError naming the field) for a malformed config or one that is none of these.
        """
        if config is None or config == {}:
            return cls()
        check_quantization_config(config)
        fp8 = config.get(FP8_ACTIVATIONS_KEY, False)
        if not isinstance(fp8, bool):
            raise QuantConfigError(FP8_ACTIVATIONS_KEY, f"expected true or false, got {fp8!r}")
        if str(config.get("quant_method", "")).lower() == QUANTIZATION_NAME and _modelopt_algo(config) is None:
            return cls(fp8_activations=fp8)
        if is_modelopt_nvfp4(config):
            from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

            delegate = _delegate(ModelOptNvFp4Config, config)
            w4a4 = delegate.quant_method == "NVFP4"
            return cls(Convention.MODELOPT, delegate=delegate, input_scales=w4a4, fp8_activations=fp8)
        if is_compressed_tensors_nvfp4(config):
            from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
                CompressedTensorsConfig,
            )

            delegate = _delegate(CompressedTensorsConfig, config)
            w4a4 = _ct_w4a4(config)
            return cls(Convention.COMPRESSED_TENSORS, delegate=delegate, input_scales=w4a4, fp8_activations=fp8)
        raise QuantConfigError(
            "quant_method",
            "nvfp4_grouped loads ModelOpt NVFP4 (quant_algo NVFP4 or W4A16_NVFP4), compressed-tensors "
            "nvfp4-pack-quantized, or BF16 checkpoints; this checkpoint declares "
            f"quant_method={config.get('quant_method')!r}, quant_algo={_modelopt_algo(config)!r}",
        )

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """Take over ModelOpt / compressed-tensors NVFP4 checkpoints when the user asked for nvfp4_grouped.

        vLLM 0.26 and 0.33 (``ModelConfig._verify_quantization``) probe custom configs first, so without the user's
        request this returns None and vLLM's own ``modelopt_fp4`` / ``compressed-tensors`` keep the checkpoint.
        """
        if user_quant != QUANTIZATION_NAME or not isinstance(hf_quant_cfg, dict):
            return None  # a malformed config: from_config names what is wrong with it
        if str(hf_quant_cfg.get("quant_method", "")).lower() == QUANTIZATION_NAME:
            return QUANTIZATION_NAME
        if is_modelopt_nvfp4(hf_quant_cfg) or is_compressed_tensors_nvfp4(hf_quant_cfg):
            return QUANTIZATION_NAME
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if compat.online_quantization(self) is not None:
            # vLLM 0.33 would wrap our method as the source of an online requantization, which needs a
            # dequantize_weight we do not have (and would undo the NVFP4 experts this config exists for).
            raise ValueError(
                f"{prefix}: nvfp4_grouped does not combine with online quantization (--quantization-config); "
                "drop that option"
            )
        if isinstance(layer, RoutedExperts):
            if self._experts_excluded(layer, prefix):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            from .moe_method import NVFP4GroupedMoEMethod

            return NVFP4GroupedMoEMethod(self, layer.moe_config)
        if self.delegate is not None:
            self.delegate.packed_modules_mapping = self.packed_modules_mapping
            return self.delegate.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def _experts_excluded(self, layer: torch.nn.Module, prefix: str) -> bool:
        """Whether the checkpoint leaves these experts unquantized (ignore / exclude_modules)."""
        if self.convention is Convention.MODELOPT:
            self.delegate.packed_modules_mapping = self.packed_modules_mapping
            return self.delegate.is_layer_excluded(prefix)
        if self.convention is Convention.COMPRESSED_TENSORS:
            self.delegate._add_fused_moe_to_target_scheme_map()
            schemes = [
                self.delegate.get_scheme_dict(layer, f"{prefix}.0.{p}") for p in ("gate_proj", "up_proj", "down_proj")
            ]
            if all(s is None for s in schemes):
                return True
            if any(s is None for s in schemes) or not all(_is_ct_nvfp4_scheme(s) for s in schemes):
                raise ValueError(
                    f"{prefix}: nvfp4_grouped needs NVFP4 gate/up/down experts, the checkpoint declares {schemes}"
                )
        return False

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.delegate is not None:
            self.delegate.apply_vllm_mapper(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        if self.delegate is not None:
            self.delegate.maybe_update_config(model_name, hf_config=hf_config, revision=revision)


def _delegate(config_cls: type[QuantizationConfig], config: dict[str, Any]) -> QuantizationConfig:
    """vLLM's own config for the checkpoint; its refusals (ValueError, pydantic's ValidationError, an assert, the
    NotImplementedError of compressed-tensors for a float of other than 4 or 8 bits, the DeprecationWarning
    raised for a sparsity config) as QuantConfigError: a bad config is one error type whatever vLLM parses it."""
    try:
        return config_cls.from_config(config)
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        AssertionError,
        NotImplementedError,
        DeprecationWarning,
    ) as e:
        raise QuantConfigError("", f"vLLM's {config_cls.__name__} refuses it: {type(e).__name__}: {e}") from e


def _is_ct_nvfp4_scheme(scheme: dict[str, Any]) -> bool:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    return CompressedTensorsConfig._is_nvfp4_format(scheme.get("weights"))
