import tempfile, sys
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w, crash
from attack.util import seqs
def main():
    root = Path(tempfile.mkdtemp()); N = ["a", "b"]
    out = run_distributed(crash.slow_peer, 2, str(root), N, float(sys.argv[1]), timeout=120)
    for o in out: print("save job:", o)
    print("a", seqs(root/"local_a"), sorted(p.name for p in (root/"local_a/step_000000004").iterdir()))
    print("b", seqs(root/"local_b"), sorted(p.name for p in (root/"local_b/step_000000004").iterdir()))
    got = run_distributed(w.load, 2, str(root), N)
    print("recover:", [(g.get("name"), g.get("tag"), g.get("rec") and g["rec"]["tier"], g.get("error")) for g in got])
if __name__ == "__main__":
    main()
