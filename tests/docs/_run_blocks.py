"""Runs the documentation's code blocks for ``test_docs.py``, in one process per kind.

    python _run_blocks.py python JOBS.json RESULTS.json
    python _run_blocks.py lightning-cli JOBS.json RESULTS.json

``JOBS.json`` is a list of ``{"id", "code"}``. Every block runs in a fresh namespace (as
``__main__``) and its own empty temporary working directory; one process per kind keeps torch's
and Lightning's import cost to once. ``RESULTS.json`` maps each id to ``null`` (it ran) or the
traceback. A LightningCLI config is instantiated the way ``examples/lightning_cli.py`` does
(``parser_mode="omegaconf"``, with its model and datamodule), without training. An option
spelled the old way (an ``ElasticDeprecationWarning``) fails its block.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_python(block_id: str, code: str) -> None:
    exec(compile(code, block_id, "exec"), {"__name__": "__main__"})


def run_lightning_cli(block_id: str, code: str) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from lightning.pytorch.cli import LightningCLI
        from lightning_cli import DemoData, DemoModel
    finally:
        sys.path.remove(str(EXAMPLES))

    Path("config.yaml").write_text(code)
    cli = LightningCLI(
        DemoModel,
        DemoData,
        args=["--config", "config.yaml"],
        run=False,
        save_config_callback=None,
        parser_kwargs={"parser_mode": "omegaconf"},
    )
    dumped = cli.parser.dump(cli.config, skip_none=False, skip_check=True)
    if "${" in dumped:
        raise AssertionError(f"an interpolation was left unresolved:\n{dumped}")


RUNNERS = {"python": run_python, "lightning-cli": run_lightning_cli}


def main() -> None:
    from lightning_elastic.errors import ElasticDeprecationWarning

    # the docs show today's spelling of every option: an old one fails its block
    warnings.filterwarnings("error", category=ElasticDeprecationWarning)
    kind, jobs_file, results_file = sys.argv[1:]
    runner = RUNNERS[kind]
    results: dict[str, Any] = {}
    home = os.getcwd()
    for job in json.loads(Path(jobs_file).read_text()):
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="doc-block-") as workdir:
            os.chdir(workdir)
            said = io.StringIO()  # what the block printed: argparse explains its exit there
            try:
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                    runner(job["id"], job["code"])
                results[job["id"]] = None
            except BaseException:  # SystemExit from argparse-based code included
                results[job["id"]] = f"{traceback.format_exc()}\noutput:\n{said.getvalue()[-4000:]}"
            finally:
                os.chdir(home)
        print(f"{job['id']}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
