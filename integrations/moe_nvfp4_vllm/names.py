"""The quantization method name, apart so that ``plugin`` (which registers it) and ``config`` (which answers to it)
both import it without importing each other."""

QUANTIZATION_NAME = "nvfp4_grouped"
