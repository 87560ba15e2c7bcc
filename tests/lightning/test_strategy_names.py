"""``Trainer(strategy="elastic")``, ``"elastic_fsdp"`` and ``"elastic_ft"`` after nothing but
``import lightning_elastic``, in a fresh interpreter, whichever of Lightning and us is imported
first (docs/getting-started.md shows the first order and runs it as written, in
tests/docs/test_docs.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

NAMES = {
    "elastic": "ElasticStrategy",
    "elastic_fsdp": "ElasticFSDPStrategy",
    "elastic_ft": "ElasticFTStrategy",
}

CHECK = """
import sys
{imports}
assert "lightning_elastic.lightning" not in sys.modules  # nothing of ours was built yet
for name, cls in {names!r}.items():
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is getattr(lightning_elastic, cls), (name, trainer.strategy)
# our modules, now imported, did not register the names a second time
from lightning.pytorch.strategies import StrategyRegistry
assert set({names!r}) <= set(StrategyRegistry.available_strategies())
assert not [f for f in sys.meta_path if type(f).__name__ == "_AwaitStrategies"]  # removed
print("ok")
"""

ORDERS = {
    "lightning_elastic_first": "import lightning_elastic\nimport lightning.pytorch as pl",
    "lightning_first": "import lightning.pytorch as pl\nimport lightning_elastic",
}


@pytest.mark.timeout(180)
def test_the_strategy_names_work_after_import_lightning_elastic_in_either_order() -> None:
    # both orders at once: each interpreter spends most of its time importing Lightning
    running = {
        order: subprocess.Popen(
            [sys.executable, "-c", CHECK.format(imports=imports, names=NAMES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for order, imports in ORDERS.items()
    }
    for order, proc in running.items():
        out, err = proc.communicate(timeout=170)
        assert proc.returncode == 0 and out.strip().endswith("ok"), (order, err[-3000:])


@pytest.mark.timeout(60)
def test_importing_lightning_elastic_alone_loads_neither_lightning_nor_torch() -> None:
    code = (
        "import sys, lightning_elastic\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert done.stdout.strip() == "[]"
