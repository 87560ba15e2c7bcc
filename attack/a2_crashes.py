"""Crash at each step of a tiered save, then recover on the same nodes."""
import tempfile, sys, time
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w, crash
from attack.util import seqs
def main():
    N = ["a", "b"]
    for point, who in [(p.split(":")[0], int(p.split(":")[1])) for p in sys.argv[1:]]:
        root = Path(tempfile.mkdtemp())
        t = time.monotonic()
        try:
            out = run_distributed(crash.crash_save, 2, str(root), N, point, who, may_die=[0, 1], timeout=90)
        except Exception as exc:
            out = f"RUN FAILED {type(exc).__name__}: {str(exc)[:300]}"
        print(f"== {point} (rank {who} dies): {out}  [{time.monotonic()-t:.1f}s]")
        print("   persistent", seqs(root/"persistent"), "a", seqs(root/"local_a"), "b", seqs(root/"local_b"))
        print("   persistent dirs", sorted(p.name for p in (root/"persistent").iterdir()))
        got = run_distributed(w.load, 2, str(root), N, timeout=90)
        print("   recover:", [(g.get("name"), g.get("tag"), g.get("rec", {}) and g["rec"]["tier"], g.get("rec") and g["rec"]["bytes"], g.get("error")) for g in got])
        out = run_distributed(w.save, 2, str(root), N, [(3, 3)], load="latest", timeout=90)
        print("   continue:", out[0])
        print("   persistent", seqs(root/"persistent"), sorted(p.name for p in (root/"persistent").iterdir()))
if __name__ == "__main__":
    main()
