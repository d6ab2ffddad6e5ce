"""The sm_90 (Hopper) backend of the 16-bit-activation MoE: everything of its path in one folder, registered as the
``triton`` backend's ``moe_w4a16`` entries (backends.py); nothing outside names these modules but the registry, the
tuner's CLI and the tools.

  configs.py         GemmConfig / MoEKernelConfig: the launch parameters, one ``is_valid`` each
  default_config.py  the deterministic default rule (shapes nobody tuned)
  tuned_configs.py   tuned files (configs/fused_moe_sm90/<device>.json), measured entries, ``select_config``
  autotune.py        the search (its space: ``neighbours``), timing and the on-disk cache
  warmup.py          the token counts whose forwards compile every variant (``warmup.compile_kernels`` runs them)
  fragment_pack.py   the packing kernel of the layout it reads (weight_layouts.Sm90Layout, ``sm90_fragments``)
  host.py            the forward: config, routing, the two GEMMs, the combine
  gemm_triton.py     the Triton GEMM kernel and its launch
  gemm_gluon.py      the warp-specialized Gluon GEMM kernel (allocates the ring, starts the partitions), its launch
  gemm_gluon_loader.py  its tile walk and loader partition (TMA weight boxes, cp.async token rows)
  gemm_gluon_mma.py  its MMA partitions: decode from shared memory, wgmma, the epilogue
  common.py          what both GEMM kernels share (decode PTX, epilogue, launch groups)
The routing and combine kernels are shared with the Blackwell host (``triton/``).
"""
