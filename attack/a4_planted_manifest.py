"""One node's manifest of the newest checkpoint is replaced by another valid manifest (copied
from an older checkpoint): the newest checkpoint, complete on node a, is dropped for everyone."""
import shutil, tempfile
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def main():
    root = Path(tempfile.mkdtemp()); N = ["a", "b"]
    run_distributed(w.save, 2, str(root), N, [(1, 1), (2, 2), (3, 3), (4, 4)], persist_every_n_saves=10, persist_last=False)
    b = root / "local_b"
    shutil.copy(b / "step_000000003/manifest.json", b / "step_000000004/manifest.json")
    print("local_a", seqs(root / "local_a"), "local_b", seqs(b))
    got = run_distributed(w.load, 2, str(root), N)
    print("recover:", [(g.get("name"), g.get("tag"), g.get("rec") and g["rec"]["tier"], g.get("error")) for g in got])
if __name__ == "__main__":
    main()
