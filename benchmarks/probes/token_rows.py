"""Probe: GEMM2's loads alone with and without the token rows' cp.async (the rows masked off: each loader
thread still arrives on the stage), i.e. what the A rows cost the loader; and block_n 256."""
import sys, tempfile, json
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from ablate_ws import ablated_source, module_from_source
from harness import measure_read_bandwidth
import loader_rate
read_bps, _ = measure_read_bandwidth()
src = ablated_source("loads_only")
old = "mask=row_ok[:, None] & k_ok[None, :])"
assert src.count(old) == 1
with tempfile.TemporaryDirectory() as tmp:
    kernels = {"loads_only": module_from_source(src, Path(tmp), "lo")._moe_gemm_ws_kernel,
               "loads_no_rows": module_from_source(src.replace(old, "mask=row_ok[:, None] & k_ok[None, :] & (kk < 0)[None, :])"), Path(tmp), "lo_noa")._moe_gemm_ws_kernel}
    for case in ("qwen3-30b-a3b:16", "qwen3-30b-a3b:64"):
        m, t = case.split(":")
        for r in loader_rate.run_case(m, int(t), ["shipped", "gemm2:block_n=128", "gemm2:block_n=256", "gemm2:block_n=256/programs_per_sm=2/max_registers=128"], ["gemm2"], kernels, read_bps):
            print("ROW", case, r["variant"], {k: round(r[k]["us"], 1) for k in kernels}, {k: round(r[k]["pct_of_read"]) for k in kernels})
