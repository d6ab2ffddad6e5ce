"""Benchmarks that ship with the package (``moe-nvfp4 bench``, ``moe-nvfp4 demo``):

  harness  timing (CUDA graphs, rotating weight copies), measured ceilings, bytes/FLOPs, floors, reports
  paths    the MoE forwards compared: ours, vLLM's Marlin / Humming NVFP4 and Triton BF16, a torch BF16 loop
  moe      the layer benchmark: shapes from the zoo or given, token counts, rows, JSON/Markdown
  device   which device a command runs on, and the one-line refusal when it cannot

Importing them needs neither a GPU nor vLLM: each path imports its own packages when it is built.
"""
