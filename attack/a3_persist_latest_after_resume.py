"""A job resumes from a local-only checkpoint and is preempted before its first save:
persist_latest() does nothing, so the newest checkpoint never reaches the persistent tier."""
import shutil, tempfile
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    root = Path(tempfile.mkdtemp()); N = ["a", "b"]
    run_distributed(w.save, 2, str(root), N, [(1, 1), (2, 2), (3, 3)], persist_every_n_saves=10, persist_last=False)
    print("persistent", seqs(root / "persistent"), "local_a", seqs(root / "local_a"))
    out = run_distributed(w.resume_persist_latest, 2, str(root), N, persist_every_n_saves=10)
    print("resumed + persist_latest:", out)
    print("persistent", seqs(root / "persistent"))
    for n in N: shutil.rmtree(root / f"local_{n}")
    got = run_distributed(w.load, 2, str(root), N)
    print("nodes lost, recover:", [(g.get("name"), g.get("tag"), g.get("error")) for g in got])
if __name__ == "__main__":
    main()
