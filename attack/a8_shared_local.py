"""Job Y reuses job X's local roots with another persistent root."""
import tempfile, os
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    root = Path(tempfile.mkdtemp()); N = ["a", "b"]
    PX, PY = str(root / "px"), str(root / "py")
    run_distributed(w.save, 2, str(root), N, [(1, 1), (2, 2), (3, 3)], persistent=PX, persist_every_n_saves=10, persist_last=False)
    got = run_distributed(w.load, 2, str(root), N, persistent=PY)
    print("Y fresh load:", [g.get("error", g)[:80] if isinstance(g.get("error"), str) else g for g in got])
    out = run_distributed(w.save, 2, str(root), N, [(2, 20), (3, 30), (4, 40), (5, 50)], persistent=PY, persist_every_n_saves=10)
    print("Y saves:", out[0])
    print("local_a", seqs(root / "local_a"), "local_b", seqs(root / "local_b"))
    got = run_distributed(w.load, 2, str(root), N, persistent=PY)
    print("Y recover:", [(g.get("name"), g.get("tag"), g.get("rec") and g["rec"]["tier"], g.get("error")) for g in got])
    got = run_distributed(w.load, 2, str(root), N, persistent=PX)
    print("X recover:", [(g.get("name"), g.get("tag"), g.get("rec") and g["rec"]["tier"], g.get("error")) for g in got])
if __name__ == "__main__":
    main()
