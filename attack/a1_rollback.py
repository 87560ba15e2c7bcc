"""Rollback on fresh nodes: the new branch reuses step names already in the persistent root."""
import shutil, sys, tempfile, logging
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    root = Path(tempfile.mkdtemp())
    N = ["a", "b"]
    # old branch: steps 1..4, tag = step, all persisted
    print(run_distributed(w.save, 2, str(root), N, [(1, 1), (2, 2), (3, 3), (4, 4)]))
    print("persistent", seqs(root / "persistent"))
    # job moves to fresh nodes and rolls back to step 2
    for n in N: shutil.rmtree(root / f"local_{n}")
    out = run_distributed(w.save, 2, str(root), N, [(2, 20), (3, 30), (4, 40)], load="step_000000001")
    print("rollback job:", out)
    print("persistent", seqs(root / "persistent"), "local_a", seqs(root / "local_a"))
    got = run_distributed(w.load, 2, str(root), N)
    print("recover (same nodes):", [(g["name"], g["tag"], g["rec"]["tier"]) for g in got])
    for n in N: shutil.rmtree(root / f"local_{n}")
    got = run_distributed(w.load, 2, str(root), N)
    print("recover (nodes lost):", [(g["name"], g["tag"], g["rec"]["tier"]) for g in got])

if __name__ == '__main__':
    main()
