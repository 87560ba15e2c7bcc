import tempfile
from lightning_elastic.testing.spawn import run_distributed
from attack import w
def main():
    out = run_distributed(w.options, 1, tempfile.mkdtemp())[0]
    for k, v in out.items(): print(f"{k:45s} {v}")
if __name__ == "__main__":
    main()
