import tempfile
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    for faults in ([dict(op="write", path="*step_*manifest.json*", error="ENOSPC", times=0, ranks=(0,))],
                   [dict(op="write", path="*.distcp", error="EIO", times=0, ranks=(1,))]):
        root = Path(tempfile.mkdtemp()); N = ["a", "b"]
        out = run_distributed(w.outage, 2, str(root), N, faults, local_keep=10)
        print("faults", faults)
        for o in out: print("  rank:", o)
        print("  local_a", list(seqs(root / "local_a")), "persistent", list(seqs(root / "persistent")))
if __name__ == "__main__":
    main()
