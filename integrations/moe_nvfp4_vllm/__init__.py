"""vLLM plugin: ``--quantization nvfp4_grouped`` runs MoE experts on moe_nvfp4's fused NVFP4 kernel.

vLLM 0.26 and 0.33 are supported; ``compat`` holds everything that differs between them.

Importing this package imports nothing from vLLM; ``plugin.register`` (the ``vllm.general_plugins`` entry
point) registers the quantization config.  Translation only: formats, validation and kernels live in moe_nvfp4.
"""

from .plugin import QUANTIZATION_NAME, register

__all__ = ["QUANTIZATION_NAME", "register"]
