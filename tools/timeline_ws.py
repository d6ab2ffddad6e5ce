"""When each program of the warp-specialized GEMMs reaches each point of its work, inside one forward.

    python tools/timeline_ws.py --case qwen3-30b-a3b:1
    python tools/timeline_ws.py --case mixtral-8x7b:1 --out benchmarks/results/archive/timeline/timeline_mixtral-8x7b_1.json

Nsight Compute times a kernel alone, with the caches flushed and no programmatic dependent launch; the forward
as served overlaps its kernels.  This edits moe_sm90_ws's source (every edit must apply once, or the run stops,
as ablate_ws.py does) so that MMA group 0 and the loader of every program write the global timer and the SM's
cycle counter at fixed points (EVENTS), loads it as a module of its own and runs the shipped config of the case
in a CUDA graph, an L2 flush before each forward (cold weights, as served), programmatic dependent launch as
shipped.  For each GEMM and point it prints when programs get there (ns after GEMM1's first program starts:
first, median, last over the programs with a tile) and each phase's length inside a program from the cycle
counter.  The stores add a few instructions per tile; outputs stay as shipped (checked against the shipped
kernel).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

from ablate_ws import _IMPORTS, KERNEL_SOURCE, module_from_source  # noqa: E402

# the points, in program order: MMA group 0's (0-4), then the loader's (5)
EVENTS = ("mma_start", "mma_waited", "first_stage", "first_tile_k_done", "mma_end", "loader_waited")
MAX_PROGRAMS = 4096  # per GEMM: the grid is SMs x programs per SM
FIELDS = 4  # per program and point: global timer (ns), SM cycle counter, SM id, tiles run so far
_STAMP = '''

@gluon.jit
def _stamp(EVENT: gl.constexpr, GATED: gl.constexpr, tiles):
    """Timeline probe (tools/timeline_ws.py): this program's global timer, SM cycle counter and SM at EVENT,
    and ``tiles`` (the tiles it has run)."""
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    slot = (((0 if GATED else 1) * MAX_PROGRAMS + gl.program_id(0)) * EVENTS + EVENT) * FIELDS
    base = gl.full([], TIMELINE_ADDRESS, gl.int64).to(gl.pointer_type(gl.int64))
    gl.store(base + slot, t)
    gl.store(base + slot + 1, c)
    gl.store(base + slot + 2, sm.to(gl.int64))
    gl.store(base + slot + 3, gl.full([], 0, gl.int64) + tiles)
'''
# (old, new) source edits; {GROUP0} guards the MMA points to group 0
_EDITS = [
    ("""    (w_smem, s_smem, a_smem, ready, empty, sums_smem, sums_full, sums_free, gs_ptr, out_ptr, stride_out, tile_map,
     topk_weights_ptr, n_out, kp) = shared
    _after_previous_kernel(PDL)
""", """    (w_smem, s_smem, a_smem, ready, empty, sums_smem, sums_full, sums_free, gs_ptr, out_ptr, stride_out, tile_map,
     topk_weights_ptr, n_out, kp) = shared
    if GROUP == 0:
        _stamp(0, GATED, 0)
    _after_previous_kernel(PDL)
    if GROUP == 0:
        _stamp(1, GATED, 0)
"""),
    ("""        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        fence_async_shared()""", """        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if GROUP == 0:
            if it == 0:  # the program's first stage
                _stamp(2, GATED, 0)
        fence_async_shared()"""),
    ("""    last = slots - K_GROUPS + GROUP  # this group's last slot of the tile
""", """    if GROUP == 0:
        if base == 0:
            _stamp(3, GATED, 1)
    last = slots - K_GROUPS + GROUP  # this group's last slot of the tile
"""),
    ("""        tiles_done += _has_rows(row0, row_end, PAIR_TILES)
""", """        tiles_done += _has_rows(row0, row_end, PAIR_TILES)
    if GROUP == 0:
        _stamp(4, GATED, tiles_done)
"""),
    ("""    _after_previous_kernel(PDL)
    num_m_tiles = _token_tiles(tile_map, PAIR_TILES)
    it = 0
""", """    _after_previous_kernel(PDL)
    _stamp(5, GATED, 0)
    num_m_tiles = _token_tiles(tile_map, PAIR_TILES)
    it = 0
"""),
]


def timeline_source(address: int) -> str:
    """moe_sm90_ws's source with the probes, writing to the int64 buffer at ``address``
    ([2 GEMMs, MAX_PROGRAMS, EVENTS, FIELDS])."""
    src = KERNEL_SOURCE.read_text()
    for old, new in _IMPORTS + _EDITS:
        if src.count(old) != 1:
            raise RuntimeError(f"timeline: the kernel source no longer has {old.strip()[:60]!r} once")
        src = src.replace(old, new)
    constants = (f"\nTIMELINE_ADDRESS = gl.constexpr({address})\nMAX_PROGRAMS = gl.constexpr({MAX_PROGRAMS})\n"
                 f"EVENTS = gl.constexpr({len(EVENTS)})\nFIELDS = gl.constexpr({FIELDS})\n")
    anchor = "\n\n@gluon.jit\ndef _after_previous_kernel"
    return src.replace(anchor, constants + _STAMP + anchor, 1)


def summarize(stamps, programs: tuple[int, int]) -> dict:
    """Per GEMM and point: ns after GEMM1's first program started (first / median / last program), and per phase
    the median length inside a program (ns, from the SM's cycle counter, at the clock the timers give: the
    median over programs of cycles over ns from the MMA group's start to its end)."""
    t0 = min(int(stamps[0, p, 0, 0]) for p in range(programs[0]))
    out = {}
    for g, name in enumerate(("gemm1", "gemm2")):
        rows = [stamps[g, p] for p in range(programs[g]) if int(stamps[g, p, 3, 0]) != 0]  # programs with a tile
        points = {}
        for e, event in enumerate(EVENTS):
            ts = sorted(int(r[e, 0]) - t0 for r in rows)
            points[event] = dict(first=ts[0], median=statistics.median(ts), last=ts[-1])
        clock_ghz = statistics.median((int(r[4, 1]) - int(r[0, 1])) / max(1, int(r[4, 0]) - int(r[0, 0])) for r in rows)
        phases = {}
        for (a, b) in ((0, 1), (1, 2), (2, 3), (3, 4)):
            cycles = [int(r[b, 1]) - int(r[a, 1]) for r in rows]
            phases[f"{EVENTS[a]} -> {EVENTS[b]}"] = statistics.median(cycles) / clock_ghz
        out[name] = dict(programs_with_tiles=len(rows), points_ns=points, phases_ns=phases, clock_ghz=clock_ghz,
                         per_sm=per_sm(rows, t0))  # fmt: skip
    return out


def per_sm(rows, t0: int) -> dict:
    """The SMs by how many tiles their programs ran: how many SMs, and when the last of each SM's programs ended
    (ns after ``t0``: first / median / last SM), and each SM's ns per tile from its first stage to its end (lowest
    / median / highest): whether the SMs with more tiles end later, and whether some SMs stream slower."""
    tiles: dict[int, int] = {}
    first: dict[int, int] = {}
    end: dict[int, int] = {}
    for r in rows:
        sm, stage, done = int(r[4, 2]), int(r[2, 0]), int(r[4, 0])
        tiles[sm] = tiles.get(sm, 0) + int(r[4, 3])
        first[sm] = min(first.get(sm, stage), stage)
        end[sm] = max(end.get(sm, done), done)
    by_tiles: dict[int, list[int]] = {}
    for sm, n in tiles.items():
        by_tiles.setdefault(n, []).append(end[sm] - t0)
    ns_per_tile = sorted((end[sm] - first[sm]) / n for sm, n in tiles.items())
    return dict(by_tiles={t: dict(sms=len(e), end_first=min(e), end_median=statistics.median(e), end_last=max(e))
                          for t, e in sorted(by_tiles.items())},
                ns_per_tile=dict(lowest=ns_per_tile[0], median=statistics.median(ns_per_tile), highest=ns_per_tile[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="qwen3-30b-a3b:1", help="model:tokens (both GEMMs must be warp-specialized)")
    p.add_argument("--replays", type=int, default=20, help="forwards; each point is the median over them")
    p.add_argument("--out", type=Path, default=None, help="JSON of the summary")
    args = p.parse_args()

    import torch

    from moe_nvfp4.configs import LayerShape, device_traits, select_config
    from moe_nvfp4.dispatch import sm_count
    from moe_nvfp4.triton import moe_sm90, moe_sm90_ws
    from tune_moe import MODELS, packed_layer, seeded_inputs

    model, tokens = args.case.split(":")
    tokens = int(tokens)
    e, k, h, i = MODELS[model]
    cfg = select_config(tokens, LayerShape(e, k, h, i), device_traits(torch.device("cuda")))
    if not (cfg.gemm1.warp_specialized and cfg.gemm2.warp_specialized):
        raise SystemExit(f"{args.case}: the shipped config runs a Triton GEMM; the probes are in the Gluon one")
    sms = sm_count(torch.device("cuda"), off_gpu=1)
    programs = (sms * cfg.gemm1.programs_per_sm, sms * cfg.gemm2.programs_per_sm)
    stamps = torch.zeros(2, MAX_PROGRAMS, len(EVENTS), FIELDS, dtype=torch.int64, device="cuda")
    weights = packed_layer(model)
    x, tw, ti = seeded_inputs(model, tokens)
    ref = moe_sm90.fused_moe_sm90(x, *weights, tw, ti, None, i, cfg)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(l2, dtype=torch.int32, device="cuda")  # 4 x L2 bytes, zeroed before each forward
    shipped = moe_sm90_ws._moe_gemm_ws_kernel
    with tempfile.TemporaryDirectory() as tmp:
        probed = module_from_source(timeline_source(stamps.data_ptr()), Path(tmp), "moe_sm90_ws_timeline")
        moe_sm90_ws._moe_gemm_ws_kernel = probed._moe_gemm_ws_kernel
        try:
            out = moe_sm90.fused_moe_sm90(x, *weights, tw, ti, None, i, cfg)  # compile outside the capture
            assert torch.equal(out, ref), "the probed kernel changed the outputs"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                flush.zero_()
                moe_sm90.fused_moe_sm90(x, *weights, tw, ti, None, i, cfg)
            runs = []
            for _ in range(args.replays):
                stamps.zero_()
                graph.replay()
                torch.cuda.synchronize()
                runs.append(stamps.cpu())
        finally:
            moe_sm90_ws._moe_gemm_ws_kernel = shipped
    summaries = [summarize(r, programs) for r in runs]
    result = {"case": args.case, "device": torch.cuda.get_device_name(), "config": cfg.to_dict(),
              "programs": programs, "replays": args.replays, "gemms": {}}  # fmt: skip
    for g in ("gemm1", "gemm2"):
        points = {ev: {q: statistics.median(s[g]["points_ns"][ev][q] for s in summaries)
                       for q in ("first", "median", "last")} for ev in EVENTS}  # fmt: skip
        phases = {ph: statistics.median(s[g]["phases_ns"][ph] for s in summaries)
                  for ph in summaries[0][g]["phases_ns"]}  # fmt: skip
        clock_ghz = statistics.median(s[g]["clock_ghz"] for s in summaries)
        # the SMs of the replay whose GEMM ended at the median time (SMs and their tiles differ between replays)
        middle = sorted(summaries, key=lambda s: s[g]["points_ns"]["mma_end"]["last"])[len(summaries) // 2]
        result["gemms"][g] = dict(programs_with_tiles=summaries[0][g]["programs_with_tiles"], points_ns=points,
                                  phases_ns=phases, clock_ghz=clock_ghz, per_sm=middle[g]["per_sm"])  # fmt: skip
        print(f"{g}: {result['gemms'][g]['programs_with_tiles']} programs with a tile; ns after GEMM1's first start "
              f"(first / median / last program); SM clock {clock_ghz:.2f} GHz")
        for ev, q in points.items():
            print(f"  {ev:<20} {q['first']:>9.0f} {q['median']:>9.0f} {q['last']:>9.0f}")
        for ph, ns in phases.items():
            print(f"  {ph:<40} {ns:>7.0f} ns inside a program (median)")
        sm = result["gemms"][g]["per_sm"]
        for tiles, q in sm["by_tiles"].items():
            print(f"  SMs with {tiles:>3} tiles: {q['sms']:>3}, ending {q['end_first']:>9.0f} {q['end_median']:>9.0f} "
                  f"{q['end_last']:>9.0f}")
        rate = sm["ns_per_tile"]
        print(f"  ns per tile on an SM: {rate['lowest']:.0f} / {rate['median']:.0f} / {rate['highest']:.0f} (lowest / "
              f"median / highest)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
