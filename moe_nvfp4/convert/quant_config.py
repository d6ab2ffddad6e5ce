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

Reading one back: ``check_quantization_config`` checks the type of every field vLLM's ModelOpt and
compressed-tensors parsers read (the vLLM plugin calls it before handing a config to them), raising
``QuantConfigError`` with the field's path; ``read_settings`` gives what inspect needs of a checked config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..checkpoint import Convention
from ..formats import NVFP4, ScaleLayout

__all__ = [
    "QuantSettings",
    "METADATA_KEY",
    "QuantConfigError",
    "check_quantization_config",
    "quantization_config",
    "hf_quant_config",
    "read_settings",
]

METADATA_KEY = "moe_nvfp4"
PRODUCER = "moe_nvfp4"
ALGO_WEIGHT_ONLY = "W4A16_NVFP4"
ALGO_W4A4 = "NVFP4"
GATE_UP_SHARED = "shared_max"  # gate and up of an expert share max(global_gate, global_up)
GATE_UP_SEPARATE = "separate"
PRODUCER_METHOD = "nvfp4_grouped"  # the vLLM plugin's method name, as a quant_method (ModelOpt fields follow)


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
            "group_0": {
                "targets": ["Linear"],
                "weights": fp4,
                "input_activations": activations,
                "format": "nvfp4-pack-quantized",
            }
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


class QuantConfigError(ValueError):
    """A checkpoint's quantization config has a field of the wrong type or value.

    ``field`` is the field's path inside the quantization config (``config_groups.group_0.targets[1]``; empty
    for the config itself); the message starts with ``quantization_config.<field>``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(
            f"quantization_config{'.' + field if field and not field.startswith('[') else field}: {message}"
        )
        self.field = field


def _join(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    return (
        "null"
        if value is None
        else {
            dict: "an object",
            list: "a list",
            str: "a string",
            bool: "a boolean",
            int: "an integer",
            float: "a number",
        }.get(type(value), type(value).__name__)
    )


def _expect(
    cfg: dict[str, Any], path: str, key: str, types: tuple[type, ...], what: str, *, required: bool = False
) -> Any:
    """``cfg[key]`` where it has one of ``types`` (a bool is never an int here), else QuantConfigError."""
    field = _join(path, key)
    if key not in cfg:
        if required:
            raise QuantConfigError(field, f"missing; expected {what}")
        return None
    value = cfg[key]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise QuantConfigError(field, f"expected {what}, got {_kind(value)} {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _module_patterns(cfg: dict[str, Any], path: str, key: str, *, required: bool = False) -> None:
    """A list of module names or ``re:<regex>`` patterns (how vLLM matches ignore lists and targets)."""
    names = _expect(cfg, path, key, (list,), "a list of module names or 're:' patterns", required=required)
    for i, name in enumerate(names or ()):
        field = _join(_join(path, key), i)
        if not isinstance(name, str) or not name:
            raise QuantConfigError(field, f"expected a module name or 're:' pattern, got {_kind(name)} {_short(name)}")
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except (re.error, RecursionError, OverflowError) as e:
                raise QuantConfigError(field, f"{name!r} is not a valid regular expression ({e})") from None


def _group_size(cfg: dict[str, Any], path: str) -> None:
    size = _expect(cfg, path, "group_size", (int, type(None)), "the integer 16 (NVFP4's block)")
    if size is not None and size != NVFP4.block_size:
        raise QuantConfigError(_join(path, "group_size"), f"NVFP4 needs group_size {NVFP4.block_size}, got {size}")


def _quantization_args(cfg: dict[str, Any], path: str, key: str, *, required: bool) -> None:
    args = _expect(
        cfg,
        path,
        key,
        (dict, type(None)) if not required else (dict,),
        "an object of quantization args",
        required=required,
    )
    if not args:
        return
    where = _join(path, key)
    bits = _expect(args, where, "num_bits", (int,), "an integer")
    if bits is not None and not 1 <= bits <= 64:
        raise QuantConfigError(_join(where, "num_bits"), f"expected 1 to 64 bits, got {bits}")
    _expect(args, where, "type", (str,), "a string (int or float)")
    _expect(args, where, "strategy", (str,), "a string (tensor_group, channel, ...)")
    _expect(args, where, "symmetric", (bool,), "a boolean")
    _expect(args, where, "dynamic", (bool, str), "a boolean or a string")
    _expect(args, where, "group_size", (int, type(None)), "an integer or null")


def _check_modelopt(cfg: dict[str, Any]) -> None:
    nested = _expect(cfg, "", "quantization", (dict,), "an object (hf_quant_config.json's form)")
    holder, path = (nested, "quantization") if nested is not None else (cfg, "")
    algo = _expect(holder, path, "quant_algo", (str,), "a string such as NVFP4 or W4A16_NVFP4", required=True)
    _group_size(holder, path)
    if nested is not None:
        # vLLM's ModelOptNvFp4Config requires all three in hf_quant_config.json's form of an NVFP4 checkpoint
        nvfp4 = "NVFP4" in algo.upper()
        if nvfp4 and "group_size" not in nested:
            raise QuantConfigError(_join(path, "group_size"), "missing; hf_quant_config.json of NVFP4 needs 16 here")
        _expect(nested, path, "kv_cache_quant_algo", (str, type(None)), "a string or null", required=nvfp4)
        _module_patterns(nested, path, "exclude_modules", required=nvfp4)
    else:
        _expect(cfg, "", "kv_cache_scheme", (dict, type(None)), "an object or null")
        _module_patterns(cfg, "", "ignore")


def _check_compressed_tensors(cfg: dict[str, Any]) -> None:
    _expect(cfg, "", "format", (str, type(None)), "a string such as nvfp4-pack-quantized")
    groups = _expect(cfg, "", "config_groups", (dict,), "an object of named config groups")
    for name, group in (groups or {}).items():
        path = _join("config_groups", name)
        if not isinstance(group, dict):
            raise QuantConfigError(
                path, f"expected an object with targets and weights, got {_kind(group)} {_short(group)}"
            )
        _module_patterns(group, path, "targets", required=True)
        _quantization_args(group, path, "weights", required=True)
        _quantization_args(group, path, "input_activations", required=False)
        _expect(group, path, "format", (str, type(None)), "a string or null")
    _module_patterns(cfg, "", "ignore")
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        _expect(cfg, "", key, (dict, type(None)), "an object or null")


def check_quantization_config(cfg: Any) -> None:
    """QuantConfigError naming the field for anything in a checkpoint's quantization config that vLLM's ModelOpt
    or compressed-tensors parser would trip on (a wrong type, a missing required field, a group_size other than
    16, an invalid ``re:`` pattern); other quant methods are only checked to be named by a string."""
    if not isinstance(cfg, dict):
        raise QuantConfigError("", f"expected a JSON object, got {_kind(cfg)} {_short(cfg)}")
    method = _expect(cfg, "", "quant_method", (str,), "a string such as modelopt or compressed-tensors")
    producer = cfg.get("producer")
    by_modelopt = isinstance(producer, dict) and producer.get("name") == "modelopt"
    method = (method or "").lower()
    nested = cfg.get("quantization")
    declares_algo = "quant_algo" in cfg or (isinstance(nested, dict) and "quant_algo" in nested)
    if method.startswith("modelopt") or by_modelopt or (method == PRODUCER_METHOD and declares_algo):
        _check_modelopt(cfg)
    elif method.replace("_", "-") == "compressed-tensors":
        _check_compressed_tensors(cfg)
