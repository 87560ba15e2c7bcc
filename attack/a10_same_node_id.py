import tempfile, os
from pathlib import Path
from lightning_elastic.testing.spawn import run_distributed
from attack import w
def main():
    root = Path(tempfile.mkdtemp())
    run_distributed(w.same_node_id, 2, str(root), 6)
    for h in ("host0", "host1"):
        d = root / h
        print(h, sorted(p.name for p in d.iterdir() if p.name.startswith("step")), sum(f.stat().st_size for f in d.rglob("*") if f.is_file()), "bytes")
if __name__ == "__main__":
    main()
