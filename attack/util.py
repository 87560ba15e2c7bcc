import json, os, sys
from pathlib import Path
def tree(root):
    root = Path(root)
    for d in sorted(root.iterdir()):
        if d.is_dir():
            print(" ", d.name, [ (p.name if p.name.endswith('json') else p.name[-14:]) for p in sorted(d.rglob('*')) if p.is_file() and 'step' in str(p)])
def seqs(path):
    out = {}
    for m in sorted(Path(path).glob("step_*/manifest.json")):
        j = json.loads(m.read_text()); out[m.parent.name] = j.get("sequence")
    return out
