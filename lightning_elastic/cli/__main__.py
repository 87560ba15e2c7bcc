"""``python -m lightning_elastic.cli``: the same as ``lightning-elastic``."""

from lightning_elastic.cli import main

raise SystemExit(main())
