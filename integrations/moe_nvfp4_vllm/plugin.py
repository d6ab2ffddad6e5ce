"""The ``vllm.general_plugins`` entry point.

vLLM 0.26 calls every general plugin in every process (API server, engine core, each worker) through
``vllm.plugins.load_general_plugins()``, once per process but possibly more than once overall, so
``register`` must be idempotent: the second call finds the name registered and returns.
"""
from __future__ import annotations

QUANTIZATION_NAME = "nvfp4_grouped"

__all__ = ["QUANTIZATION_NAME", "register"]


def register() -> None:
    """Register ``nvfp4_grouped`` with vLLM's quantization registry (safe to call any number of times)."""
    from vllm.model_executor.layers.quantization import (
        _CUSTOMIZED_METHOD_TO_QUANT_CONFIG,
        register_quantization_config,
    )

    from .config import NVFP4GroupedConfig

    if _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(QUANTIZATION_NAME) is NVFP4GroupedConfig:
        return
    register_quantization_config(QUANTIZATION_NAME)(NVFP4GroupedConfig)
