"""Benchmarks that ship with the package (``moe-nvfp4 bench``, ``moe-nvfp4 demo``):

  harness  timing (CUDA graphs, rotating weight copies), measured ceilings, floors, reports
  shape    a bench case's layer (MoEShape, spelled as shapes.LayerShape) and its bytes and FLOPs
  paths    the MoE forwards compared and their registry: ours and a torch BF16 loop here, vLLM's Marlin /
           Humming NVFP4 and Triton BF16 in vllm_paths, the batched format's in batched_paths (path_base: the
           Path they all are)
  moe      the layer benchmark's command line and run: shapes from the zoo, drawn at random or given, token counts
  layer    one shape's rows: weights, inputs, the paths built, outputs checked, timed in turns, ratios
  report   columns, per-model lines, the prefill summary, the header (GPU or CPU), JSON/Markdown
  device   which device a command runs on, and the one-line refusal when it cannot

Importing them needs neither a GPU nor vLLM: each path imports its own packages when it is built.
"""
