import tempfile, shutil, json
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
from attack.util import seqs
def sizes(d):
    m = json.loads((d / "manifest.json").read_text())
    return sum(f["size"] for f in m["files"]), m.get("total_bytes"), sum(p.stat().st_size for p in d.iterdir() if p.name != "manifest.json")
def main():
    root = Path(tempfile.mkdtemp())
    run_distributed(w.save, 3, str(root), ["a", "b", "c"], [(1, 1), (2, 2)], persist_every_n_saves=10)
    d = root / "local_a/step_000000002"
    print("files-sum, total_bytes, on-disk (node a):", sizes(d), sorted(p.name[-20:] for p in d.iterdir()))
    shutil.rmtree(root / "local_b")
    got = run_distributed(w.load, 2, str(root), ["a", "c"])
    print("3->2 (b lost):", [(g.get("name"), g.get("w"), g.get("rec") and (g["rec"]["tier"], g["rec"]["bytes"]), g.get("error")) for g in got])
    got = run_distributed(w.load, 3, str(root), ["a", "c", "d"], replicas=4)
    print("2->3 (new d), replicas=4:", [(g.get("name"), g.get("w"), g.get("rec") and (g["rec"]["tier"], g["rec"]["bytes"]), g.get("error")) for g in got])
    out = run_distributed(w.save, 3, str(root), ["a", "c", "d"], [(3, 3)], load="latest", replicas=4)
    print("save after, replicas=4:", out[0])
    for n in "acd": print(n, sorted(p.name[-20:] for p in (root / f"local_{n}/step_000000003").iterdir()))
    got = run_distributed(w.load, 1, str(root), ["a"])
    print("3->1:", [(g.get("name"), g.get("w"), g.get("rec") and (g["rec"]["tier"], g["rec"]["bytes"]), g.get("error")) for g in got])
if __name__ == "__main__":
    main()
