"""PTX surgery for a probe: drop the CTA-partition barriers Triton's membar pass puts (a) in the Gluon loader's
stage loop, before each expect-tx, TMA issue and token-row cp.async, and (b) in the MMA warps right before an
mbarrier try_wait.  Neither orders anything those ops need (an mbarrier phase cannot complete before its
expect-arrive; a try_wait reads no data).  Usage: strip_bars.py SRC_DIR DST_DIR (dump-layout dirs)."""
import pathlib, re, sys

OPS = re.compile(r"mbarrier\.arrive\.expect_tx|cp\.async\.bulk\.tensor|cp\.async\.cg\.shared\.global|mbarrier\.try_wait")
STOP = re.compile(r"\b(mbarrier\.init|fence|griddepcontrol|ld\.shared|st\.shared|wgmma|stmatrix|ldmatrix|bar\.sync|barrier\.sync|mbarrier\.arrive\.shared|ld\.global|st\.global|atom)\b")


def strip(ptx: str) -> tuple[str, int]:
    lines = ptx.split("\n")
    out, dropped = [], 0
    for n, line in enumerate(lines):
        if re.match(r"\s*bar\.sync\s", line):
            for nxt in lines[n + 1 : n + 16]:
                if OPS.search(nxt):
                    dropped += 1
                    line = None
                    break
                if STOP.search(nxt):
                    break
        if line is not None:
            out.append(line)
    return "\n".join(out), dropped


src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for f in sorted(src.glob("*/_moe_gemm_ws_kernel.ptx")):
    text, dropped = strip(f.read_text())
    (dst / f.parent.name).mkdir(parents=True, exist_ok=True)
    (dst / f.parent.name / f.name).write_text(text)
    print(f.parent.name[:8], "dropped", dropped, "of", f.read_text().count("bar.sync"))
