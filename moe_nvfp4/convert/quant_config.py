"""Quantization configs written beside the weights, in the forms vLLM 0.26 parses, plus our own metadata.

ModelOpt (``quant_method: modelopt``): ``config.json`` gets the flat form that
``ModelOptQuantConfigBase.from_config`` reads (``quant_algo``, ``group_size``, ``ignore``); ``hf_quant_config.json``
gets the nested form (``quantization: {quant_algo, group_size, kv_cache_quant_algo, exclude_modules}``), all
three fields being required there by ``ModelOptNvFp4Config._from_config``.

compressed-tensors (``quant_method: compressed-tensors``, ``format: nvfp4-pack-quantized``): one config group
targeting ``Linear`` with float 4-bit ``tensor_group`` weights of group 16; ``input_activations`` null for
weight-only (vLLM's NVFP4A16 path) or NVFP4 for W4A4.

Weight-only conversion (the default) has no calibration data, so it writes no input scales and declares
``W4A16_NVFP4``: vLLM 0.26 then runs activations in BF16 (Marlin) and never reads an input scale.  W4A4 needs
``input_amax``: every quantized layer then gets ``input_scale = input_amax / (6 * 448)`` and ``NVFP4``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import Convention
from ..formats import NVFP4, ScaleLayout

__all__ = ["QuantSettings", "METADATA_KEY", "quantization_config", "hf_quant_config", "read_settings"]

METADATA_KEY = "moe_nvfp4"
PRODUCER = "moe_nvfp4"
ALGO_WEIGHT_ONLY = "W4A16_NVFP4"
ALGO_W4A4 = "NVFP4"
GATE_UP_SHARED = "shared_max"  # gate and up of an expert share max(global_gate, global_up)
GATE_UP_SEPARATE = "separate"


@dataclass(frozen=True)
class QuantSettings:
    """What the converter wrote: convention, gate/up global-scale policy and the input-scale rule."""

    convention: Convention = Convention.MODELOPT
    separate_gate_up_scales: bool = False
    input_amax: float | None = None  # None: weight-only (W4A16), no input scales

    def __post_init__(self) -> None:
        if self.input_amax is not None and not (self.input_amax > 0 and self.input_amax < float("inf")):
            raise ValueError(f"input_amax must be a finite positive activation bound, got {self.input_amax}")

    @property
    def quant_algo(self) -> str:
        return ALGO_WEIGHT_ONLY if self.input_amax is None else ALGO_W4A4

    @property
    def input_scale(self) -> float | None:
        """ModelOpt input scale (a multiplier) for every quantized layer, or None."""
        return None if self.input_amax is None else self.input_amax / (NVFP4.value_max * NVFP4.scale_max)

    def metadata(self) -> dict[str, Any]:
        from .. import __version__

        return {
            "format_version": NVFP4.version,
            "scale_layout": ScaleLayout.LINEAR.value,
            "gate_up_global_scale": GATE_UP_SEPARATE if self.separate_gate_up_scales else GATE_UP_SHARED,
            "input_scale": (
                "none: weight-only, activations stay bf16"
                if self.input_amax is None
                else f"uniform, not calibrated: input_amax {self.input_amax} / (6 * 448)"
            ),
            "converter_version": __version__,
        }


def _producer() -> dict[str, str]:
    from .. import __version__

    return {"name": PRODUCER, "version": __version__}


def quantization_config(settings: QuantSettings, ignore: list[str]) -> dict[str, Any]:
    """``quantization_config`` for config.json; ``ignore`` lists the unquantized linear modules."""
    if settings.convention is Convention.MODELOPT:
        return {
            "quant_method": "modelopt",
            "quant_algo": settings.quant_algo,
            "group_size": NVFP4.block_size,
            "kv_cache_scheme": None,
            "ignore": ignore,
            "producer": _producer(),
            METADATA_KEY: settings.metadata(),
        }
    fp4 = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": NVFP4.block_size,
        "symmetric": True,
        "dynamic": False,
    }
    activations = None if settings.input_amax is None else {**fp4, "dynamic": "local"}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": fp4, "input_activations": activations, "format": "nvfp4-pack-quantized"}
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "producer": _producer(),
        METADATA_KEY: settings.metadata(),
    }


def hf_quant_config(settings: QuantSettings, ignore: list[str]) -> dict[str, Any]:
    """``hf_quant_config.json`` (ModelOpt only)."""
    return {
        "producer": _producer(),
        "quantization": {
            "quant_algo": settings.quant_algo,
            "group_size": NVFP4.block_size,
            "kv_cache_quant_algo": None,
            "exclude_modules": ignore,
        },
        METADATA_KEY: settings.metadata(),
    }


def read_settings(config: dict[str, Any]) -> tuple[str | None, bool | None, dict[str, Any] | None]:
    """From a config.json: (quant_algo or None, whether W4A4 input scales are expected or None, our metadata)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None, None, None
    ours = qc.get(METADATA_KEY) if isinstance(qc.get(METADATA_KEY), dict) else None
    if qc.get("quant_method") == "compressed-tensors":
        groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
        w4a4 = any(isinstance(g, dict) and g.get("input_activations") for g in groups.values())
        return "NVFP4" if w4a4 else ALGO_WEIGHT_ONLY, w4a4, ours
    nested = qc.get("quantization")
    algo = (nested if isinstance(nested, dict) else qc).get("quant_algo")
    if not isinstance(algo, str):
        return None, None, ours
    algo = str(algo).upper()
    return algo, algo == ALGO_W4A4, ours
