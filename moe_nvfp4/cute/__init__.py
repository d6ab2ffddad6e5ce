"""Blackwell (sm_100a) kernels in CuTe DSL.  Importing this package does not import cutlass."""
