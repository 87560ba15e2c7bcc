"""Rollback then one save named like an abandoned persisted one: recovery loads the ABANDONED branch.
is silently not persisted and, with the nodes intact, recovery skips it."""
import shutil, tempfile
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    root = Path(tempfile.mkdtemp()); N = ["a", "b"]
    run_distributed(w.save, 2, str(root), N, [(1, 1), (2, 2), (3, 3), (4, 4)], persist_every_n_saves=1)
    print("persistent", seqs(root / "persistent"))
    for n in N: shutil.rmtree(root / f"local_{n}")
    out = run_distributed(w.save, 2, str(root), N, [(4, 40)], load="step_000000001", persist_every_n_saves=10)
    print("rollback job names", out[0]["names"], "errors", out[0]["errors"])
    print("persistent", seqs(root / "persistent"), "local_a", seqs(root / "local_a"))
    got = run_distributed(w.load, 2, str(root), N)
    print("recover (same nodes):", got)
if __name__ == "__main__":
    main()
