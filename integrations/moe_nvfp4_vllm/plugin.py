"""The ``vllm.general_plugins`` entry point.

vLLM (0.26 and 0.33 alike) calls every general plugin in every process (API server, engine core, each
worker) through ``vllm.plugins.load_general_plugins()``, once per process but possibly more than once overall,
so ``register`` must be idempotent: the second call finds the name registered and returns.
"""

from __future__ import annotations

from .names import QUANTIZATION_NAME

__all__ = ["QUANTIZATION_NAME", "register"]


def register() -> None:
    """Register ``nvfp4_grouped`` with vLLM's quantization registry (safe to call any number of times).

    On a vLLM release we do not support it logs an error naming the supported ones and registers nothing: vLLM
    runs this in every process whether or not the user asked for nvfp4_grouped, so it must not raise.
    """
    from vllm.logger import init_logger

    from . import compat

    if not compat.is_supported():
        init_logger(f"vllm.{__name__}").error(
            "nvfp4_grouped is not registered: it supports %s, this is vLLM %s",
            compat.SUPPORTED,
            compat.vllm.__version__,
        )
        return
    from vllm.model_executor.layers.quantization import (
        _CUSTOMIZED_METHOD_TO_QUANT_CONFIG,
        register_quantization_config,
    )

    from .config import NVFP4GroupedConfig

    if _CUSTOMIZED_METHOD_TO_QUANT_CONFIG.get(QUANTIZATION_NAME) is NVFP4GroupedConfig:
        return
    register_quantization_config(QUANTIZATION_NAME)(NVFP4GroupedConfig)
