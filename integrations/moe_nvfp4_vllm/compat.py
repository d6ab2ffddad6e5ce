"""The vLLM releases nvfp4_grouped runs on, and everything that differs between them on the paths it takes.

Supported: vLLM 0.26.x (verified end to end on H100/H200) and 0.33.x (CPU tests only: 0.33 pins torch 2.14 and
the GPU image has torch 2.11).  Both build ``RoutedExperts`` the same way, load through the same weight loader
and call ``apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)`` from the MoE runner;
what 0.33 changed on our paths is handled here, and nowhere else in the plugin looks at the release:

==========================================  ================================  =====================================
path                                        vLLM 0.26                         vLLM 0.33
==========================================  ================================  =====================================
modular-kernel setup after loading          ``MoERunner.maybe_init_modular_   removed (a method sets ``moe_kernel``
                                            kernel`` asks a method without    itself or implements ``apply``)
                                            ``moe_kernel`` for a prepare/
                                            finalize
DP + EP with an all2all backend             the method holds ``moe_kernel``   the same
                                            (``modular.make_moe_kernel``: our
                                            experts in vLLM's modular kernel)
output of ``apply``                         always finalized                  may be an ``UnfinalizedMoEOutput``
                                                                              when the model asked to defer
``QuantizationConfig``                      ``is_mxfp4_quant`` (base: False)  ``online_quantization_config`` wraps
                                                                              methods (``resolve_quant_method``)
ModelOpt NVFP4 linear layers (delegated)    ``ModelOptNvFp4(W4A16)Linear-     ``ModelOptLinearMethod(spec, ctx,
                                            Method``                          format_scheme)``
==========================================  ================================  =====================================
"""

from __future__ import annotations

import vllm

__all__ = [
    "RELEASES",
    "SUPPORTED",
    "VLLM_RELEASE",
    "MoEMethodCompat",
    "check_supported",
    "is_supported",
    "keep_finalized",
    "online_quantization",
]

SUPPORTED = "vLLM 0.26.x (verified on H100/H200) or 0.33.x (CPU tests only)"
RELEASES = ((0, 26), (0, 33))  # (major, minor); pyproject.toml's [vllm] extra admits the same


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


VLLM_RELEASE = _release(vllm.__version__)  # (major, minor) of the vLLM this process imports


def is_supported() -> bool:
    return VLLM_RELEASE in RELEASES


def check_supported() -> None:
    """Raise a RuntimeError naming the supported releases when this vLLM is not one of them."""
    if not is_supported():
        raise RuntimeError(
            f"nvfp4_grouped supports {SUPPORTED} (pip install 'moe-nvfp4[vllm]'); this is vLLM {vllm.__version__}"
        )


if VLLM_RELEASE == (0, 26):

    class MoEMethodCompat:
        """vLLM 0.26: after loading, ``MoERunner.maybe_init_modular_kernel`` asks a method without ``moe_kernel``
        for a prepare/finalize and would wrap it in ``FusedMoEModularMethod``, which reads ``layer.w13_weight`` (our
        packed weights live elsewhere).  Where vLLM runs an all2all the method holds its own kernel
        (``modular.make_moe_kernel``, as on 0.33) and this is never asked; elsewhere (TP, DP without EP) None keeps
        the runner's path around ``apply``."""

        def maybe_make_prepare_finalize(self, routing_tables=None):
            return None

    def keep_finalized(moe_config) -> None:
        """vLLM 0.26 has no deferred finalize: ``apply``'s output is always the finished sum."""

    def online_quantization(quant_config):
        """vLLM 0.26 has no online requantization of checkpoint methods."""
        return None

else:

    class MoEMethodCompat:
        """vLLM 0.33 removed ``maybe_make_prepare_finalize`` / ``select_gemm_impl`` and the runner's legacy
        modular-kernel path: a method without ``moe_kernel`` keeps the naive dispatch/combine and its ``apply``."""

    def keep_finalized(moe_config) -> None:
        """vLLM 0.33: a model may ask its MoE layers to defer the top-k reduction (``defer_moe_finalize``) and then
        expect an ``UnfinalizedMoEOutput`` wherever ``should_defer_moe_finalize`` says yes.  ``apply`` always returns
        the finished sum, so cap deferral at zero tokens: the answer is then always no (the cap only goes down)."""
        moe_config.limit_deferred_moe_finalize(0)

    def online_quantization(quant_config):
        """vLLM 0.33: the online requantization config the loader attached (``--quantization-config``), or None."""
        return quant_config.online_quantization_config
