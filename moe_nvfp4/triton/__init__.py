"""Hopper (sm_90) kernels written in Triton: one module per kernel family."""
