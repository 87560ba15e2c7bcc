"""Every fenced code block of README.md and docs/*.md runs as written, or says why it cannot.

* ``python``: compiled; then executed, each in a fresh namespace and an empty temporary
  directory (all blocks in one subprocess, see ``_run_blocks.py``);
* ``yaml``: parsed; a LightningCLI config (a top-level ``trainer``/``model``/``data`` key) is
  also instantiated the way ``examples/lightning_cli.py`` does (omegaconf interpolations
  resolved), without training;
* ``bash``: every ``lightning-elastic`` command line is parsed by the CLI's own argparse parser,
  without running it; a block with any other command needs a skip marker;
* ``text`` and ``mermaid``: a layout, an output or a diagram, not code (skipped, and reported
  as such).

A block that cannot run here (an S3 URL, a multi-process training, torchrun on several nodes,
an installation) carries a marker on the line before its fence, and is reported as skipped
with the reason::

    <!-- doctest: skip (trains on 2 processes for minutes) -->

A block whose point is what a new interpreter does (an import that must be enough on its own)
runs alone in a fresh one instead of beside the other blocks::

    <!-- doctest: fresh (the import alone registers the strategy names) -->

Python blocks are compiled even when skipped. Nothing is shrunk or substituted: a block that
runs, runs exactly as the reader would copy it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_elastic.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("_run_blocks.py")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*doctest:(?P<body>.*?)-->\s*$")
SKIP = re.compile(r"^\s*skip\s*\((?P<reason>.+)\)\s*$")
FRESH = re.compile(r"^\s*fresh\s*\((?P<reason>.+)\)\s*$")
LANGUAGES = {
    "python": "python",
    "py": "python",
    "yaml": "yaml",
    "yml": "yaml",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
    "text": "text",
    "mermaid": "diagram",
}
NOT_CODE = {"text": "text (a layout or an output), not code", "diagram": "a diagram, not code"}
LIGHTNING_CLI_KEYS = {"trainer", "model", "data", "seed_everything", "ckpt_path"}
RUN_TIMEOUT_S = 240
# the complete config the README points to (run by the demo): checked like a block
EXAMPLE_CONFIG = "examples/config.yaml"


@dataclass(frozen=True)
class Block:
    doc: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str  # normalised (see LANGUAGES); "" when the fence names none
    info: str  # the fence's info string as written
    code: str
    skip: str | None  # the marker's reason
    fresh: str | None = None  # runs alone in a new interpreter, for this reason

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{self.info or 'untagged'}"


class DocError(ValueError):
    """A malformed block or marker (reported by the test of the block it belongs to)."""


def extract(text: str, doc: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, with the skip marker preceding each."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(
            rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[i]
        ):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        info_word = info.split()[0].lower() if info else ""
        skip, fresh = _marker(lines, start)
        blocks.append(
            Block(
                doc=doc,
                line=start + 1,
                language=LANGUAGES.get(info_word, info_word),
                info=info_word,
                code="\n".join(body) + "\n",
                skip=skip,
                fresh=fresh,
            )
        )
    return blocks


def _marker(lines: list[str], fence_index: int) -> tuple[str | None, str | None]:
    """The reasons of a ``skip`` and of a ``fresh`` marker before the fence (either or none)."""
    j = fence_index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0:
        return None, None
    match = MARKER.match(lines[j])
    if match is None:
        return None, None
    skip, fresh = SKIP.match(match["body"]), FRESH.match(match["body"])
    found = skip or fresh
    if found is None or not found["reason"].strip():
        raise DocError(
            f"line {j + 1}: unknown doctest marker {lines[j].strip()!r}; "
            "write <!-- doctest: skip (the reason) --> or <!-- doctest: fresh (the reason) -->"
        )
    reason = found["reason"].strip()
    return (reason, None) if skip else (None, reason)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block | tuple[str, str]]:
    """Every block; a document that cannot be parsed becomes ``(doc, error)``."""
    out: list[Block | tuple[str, str]] = []
    for path in documents():
        doc = str(path.relative_to(ROOT))
        try:
            out.extend(extract(path.read_text(), doc))
        except DocError as exc:
            out.append((doc, str(exc)))
    return out


BLOCKS = all_blocks()


def _id(item: Block | tuple[str, str]) -> str:
    return item.id if isinstance(item, Block) else f"{item[0]}:marker"


# ----------------------------------------------------------------------------- classification


def lightning_cli_config(block: Block) -> bool:
    data = yaml.safe_load(block.code)
    return isinstance(data, dict) and bool(LIGHTNING_CLI_KEYS & set(data))


def command_lines(code: str) -> list[list[str]]:
    """Each command of a shell block as argv (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


def to_execute(block: Block) -> str | None:
    """The subprocess kind that runs ``block``, if any."""
    if block.skip is not None:
        return None
    if block.language == "python":
        return "python"
    if block.language == "yaml" and lightning_cli_config(block):
        return "lightning-cli"
    return None


# ----------------------------------------------------------------------------- execution

_results: dict[str, str | None] = {}


def _execute_all() -> dict[str, str | None]:
    """Run every runnable block once, one subprocess per kind (and one for each ``fresh``
    block), all at the same time."""
    if _results:
        return _results
    jobs: dict[tuple[str, str], list[dict[str, str]]] = {}  # (kind, group) -> blocks
    for block in BLOCKS:
        if isinstance(block, Block) and (kind := to_execute(block)) is not None:
            group = block.id if block.fresh else ""
            jobs.setdefault((kind, group), []).append({"id": block.id, "code": block.code})
    example = (ROOT / EXAMPLE_CONFIG).read_text()
    jobs.setdefault(("lightning-cli", ""), []).append({"id": EXAMPLE_CONFIG, "code": example})
    with tempfile.TemporaryDirectory(prefix="doc-blocks-") as tmp:
        procs: list[tuple[list[dict[str, str]], Path, subprocess.Popen[str]]] = []
        for n, ((kind, _group), kind_jobs) in enumerate(jobs.items()):
            jobs_file, results_file = Path(tmp, f"{kind}-{n}.jobs"), Path(tmp, f"{kind}-{n}.json")
            jobs_file.write_text(json.dumps(kind_jobs))
            cmd = [sys.executable, str(RUNNER), kind, str(jobs_file), str(results_file)]
            proc = subprocess.Popen(
                cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            procs.append((kind_jobs, results_file, proc))
        for kind_jobs, results_file, proc in procs:
            try:
                output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
                output += f"\n(killed after {RUN_TIMEOUT_S} s)"
            done: dict[str, Any] = (
                json.loads(results_file.read_text()) if results_file.exists() else {}
            )
            for job in kind_jobs:
                if job["id"] in done:
                    _results[job["id"]] = done[job["id"]]
                else:
                    _results[job["id"]] = f"the runner never finished this block:\n{output}"
    return _results


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("item", BLOCKS, ids=_id)
def test_every_block_runs_or_says_why_not(item: Block | tuple[str, str]) -> None:
    if not isinstance(item, Block):
        pytest.fail(f"{item[0]}: {item[1]}")
    block = item
    where = f"{block.doc}, line {block.line}"
    if block.language == "python":
        compile(block.code, where, "exec")  # even a skipped block must be valid Python
    if block.skip is not None:
        pytest.skip(f"{where}: {block.skip}")
    if block.language == "":
        pytest.fail(f"{where}: name the block's language (python, yaml, bash, text)")
    if block.language in NOT_CODE:
        pytest.skip(f"{where}: {NOT_CODE[block.language]}")
    if block.language == "yaml":
        yaml.safe_load(block.code)
    if block.language == "bash":
        _check_bash(block, where)
        return
    kind = to_execute(block)
    if kind is not None:
        error = _execute_all()[block.id]
        assert error is None, f"{where} ({kind}) failed:\n{error}"
    elif block.language not in ("yaml",):
        pytest.fail(
            f"{where}: no runner for {block.info!r} blocks; "
            "add <!-- doctest: skip (the reason) --> before it"
        )


def _check_bash(block: Block, where: str) -> None:
    commands = command_lines(block.code)
    others = [argv[0] for argv in commands if argv[0] != "lightning-elastic"]
    if others:
        pytest.fail(
            f"{where}: runs {sorted(set(others))}, which this test cannot check; "
            "add <!-- doctest: skip (the reason) --> before it"
        )
    assert commands, f"{where}: an empty shell block"
    for argv in commands:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                _parser().parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(
                f"{where}: `{shlex.join(argv)}` does not parse ({exc}): {stderr.getvalue()}"
            )


def test_the_example_lightning_cli_config_instantiates() -> None:
    error = _execute_all()[EXAMPLE_CONFIG]
    assert error is None, f"{EXAMPLE_CONFIG} failed:\n{error}"


def test_the_extractor_reads_markers_languages_and_nested_fences() -> None:
    text = (
        "# Title\n\n"
        "<!-- doctest: skip (needs S3) -->\n"
        "```python\nprint(1)\n```\n\n"
        "````markdown\n```python\nnot a block of its own\n```\n````\n\n"
        "```\nuntagged\n```\n"
    )
    blocks = extract(text, "x.md")
    assert [(b.line, b.language, b.skip) for b in blocks] == [
        (4, "python", "needs S3"),
        (8, "markdown", None),
        (14, "", None),
    ]
    fresh = extract("<!-- doctest: fresh (an import order) -->\n```python\npass\n```\n", "x.md")
    assert [(b.skip, b.fresh) for b in fresh] == [(None, "an import order")]
    assert blocks[1].code == "```python\nnot a block of its own\n```\n"
    with pytest.raises(DocError, match="unknown doctest marker"):
        extract("<!-- doctest: skipp -->\n```python\npass\n```\n", "x.md")


def test_command_lines_join_continuations_and_drop_comments() -> None:
    code = "lightning-elastic ls runs/x   # list\n\n# a comment\nfoo --a \\\n    --b c\n"
    assert command_lines(code) == [
        ["lightning-elastic", "ls", "runs/x"],
        ["foo", "--a", "--b", "c"],
    ]
