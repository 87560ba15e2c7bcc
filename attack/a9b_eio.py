import tempfile, time
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    faults = [dict(op="write", path="*.distcp", error="EIO", times=0, ranks=(1,))]
    root = Path(tempfile.mkdtemp()); N = ["a", "b"]
    t = time.monotonic()
    try:
        out = run_distributed(w.outage, 2, str(root), N, faults, steps=4, local_keep=10, timeout=400)
        for o in out: print("  rank:", o)
    except Exception as exc:
        print("RUN", type(exc).__name__, str(exc)[:2000])
    print(f"  {time.monotonic()-t:.0f}s local_a", list(seqs(root / "local_a")), "persistent", list(seqs(root / "persistent")))
if __name__ == "__main__":
    main()
