"""The run report behind ``lightning-elastic report``: what a checkpoint directory says about
the runs that wrote it, from the manifests (through the catalog) and the run history.

:func:`build_report` gathers the data (plain JSON, what ``--json`` prints);
:func:`render_text` writes the summary; :func:`render_html` a self-contained page (figures
embedded as PNG when matplotlib is installed, tables always). Imports neither torch nor
Lightning; matplotlib only inside :func:`render_html`.
"""

from __future__ import annotations

from lightning_elastic.report.data import REPORT_VERSION, CheckpointRow, build_report
from lightning_elastic.report.html import render_html
from lightning_elastic.report.text import render_text

__all__ = ["REPORT_VERSION", "CheckpointRow", "build_report", "render_html", "render_text"]
