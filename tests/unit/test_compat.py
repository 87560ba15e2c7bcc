"""The private APIs we rely on still exist, and the core/CLI never import Lightning."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torchmetrics

from lightning_elastic.core import _compat as core_compat
from lightning_elastic.lightning import _compat as lightning_compat


@pytest.mark.parametrize("module", [core_compat, lightning_compat], ids=["torch", "lightning"])
def test_every_private_api_we_use_still_exists(module: object) -> None:
    gone = module.missing()  # type: ignore[attr-defined]
    assert not gone, (
        f"an upgrade removed private APIs that {module.__name__} wraps: {gone}; "  # type: ignore[attr-defined]
        "adapt the function there that uses each one"
    )


def test_torchmetrics_keeps_update_count_and_reductions_on_instances() -> None:
    metric = torchmetrics.SumMetric()
    metric.update(torch.tensor(2.0))
    assert lightning_compat.metric_update_count(metric) == 1
    assert set(lightning_compat.metric_reductions(metric)) == set(metric.metric_state)
    lightning_compat.set_metric_update_count(metric, 5)
    assert lightning_compat.metric_update_count(metric) == 5


def test_lightning_strategies_keep_the_attributes_our_strategies_read() -> None:
    """What lightning/_compat.py reads and writes on a strategy (instance attributes)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    ddp = DDPStrategy()
    lightning_compat.set_strategy_devices(ddp, [torch.device("cpu")] * 2)
    lightning_compat.set_strategy_nodes(ddp, 3)
    assert ddp.parallel_devices == [torch.device("cpu")] * 2 and ddp.num_nodes == 3
    assert lightning_compat.strategy_nodes(ddp) == 3
    assert lightning_compat.process_group_backend(ddp) == "gloo"  # no accelerator: gloo
    assert lightning_compat.process_group_timeout(DDPStrategy(timeout=timedelta(seconds=7)))
    sharded = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=2)
    assert lightning_compat.parallel_sizes(sharded) == ("auto", 2)
    lightning_compat.set_data_parallel_size(sharded, 4)
    assert lightning_compat.parallel_sizes(sharded) == (4, 2)


def test_torch_keeps_the_elastic_agent_restart_budget_and_the_public_tcp_store() -> None:
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    class Agent:  # the attribute SimpleElasticAgent.__init__ sets, on a stand-in
        _remaining_restarts = 2

    assert "_remaining_restarts" in SimpleElasticAgent.__init__.__code__.co_names
    assert core_compat.give_back_restart(Agent()) == 3
    assert core_compat.tcp_store_class() is torch.distributed.TCPStore


def test_a_missing_requirement_is_named() -> None:
    assert core_compat.unmet((("torch", "no_such_attribute"), ("no_such_module", "x"))) == [
        "torch:no_such_attribute",
        "no_such_module:x",
    ]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(out.split())


def test_importing_the_package_the_core_or_the_cli_never_imports_lightning() -> None:
    loaded = _modules_after(
        "import lightning_elastic, lightning_elastic.core, lightning_elastic.errors, "
        "lightning_elastic.cli, lightning_elastic.core.engine, "
        # what moved out of lightning/: the health monitor, the save schedule, the fork check
        # and the shard plan
        "lightning_elastic.core.observe.monitor, lightning_elastic.core.policy.schedule, "
        "lightning_elastic.core.forking_loaders, lightning_elastic.core.elastic.shards"
    )
    assert "lightning" not in loaded and "lightning.pytorch" not in loaded


def test_manifest_only_cli_verbs_import_neither_lightning_nor_torch(tmp_path: object) -> None:
    code = (
        "from lightning_elastic.cli import main\n"
        f"for argv in (['ls', {str(tmp_path)!r}], ['prune', {str(tmp_path)!r}, '--keep-last', '1'],"
        f" ['verify', {str(tmp_path)!r}, '--mode', 'size']):\n"
        "    main(argv)\n"
    )
    loaded = _modules_after(code)
    assert "torch" not in loaded and "lightning" not in loaded


def test_lightning_keeps_the_training_loader_attributes_we_read_on_a_live_trainer(
    tmp_path: object,
) -> None:
    """The instance attributes behind ``train_combined_loader``, ``train_loader_mode``,
    ``train_loader_states``, ``prefetched_batches``, ``pending_loader_states`` and
    ``validates_by_time`` exist on a
    trainer that has set its data up."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen: list[object] = []

    class Look(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            fetcher = trainer.fit_loop._data_fetcher
            seen.append((hasattr(fetcher, "batches"), lightning_compat.prefetched_batches(trainer)))
            seen.append(lightning_compat.train_loader_states(trainer))

    trainer = pl.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=0.5,
        callbacks=[Look()],
    )
    trainer.fit(BoringModel())
    assert seen == [(True, 0), []]  # a sized loader, nothing fetched ahead; none stateful
    combined = lightning_compat.train_combined_loader(trainer)
    assert combined is not None and hasattr(combined, "_mode")
    assert lightning_compat.train_loader_mode(combined) == "max_size_cycle"
    assert hasattr(trainer, "_val_check_time_interval")
    assert hasattr(trainer.fit_loop, "_combined_loader_states_to_load")
    assert lightning_compat.pending_loader_states(trainer) == []
    assert not lightning_compat.validates_by_time(trainer)
    assert lightning_compat.limit_train_batches(64, 0.5) == 32


def test_lightning_keeps_what_self_log_leaves_behind_where_we_read_it(tmp_path: object) -> None:
    """The logger connector's instance attributes behind ``logger_connector_state`` exist on a
    live trainer, and a ``_ResultMetric`` rebuilt from ``result_entry`` has the very metadata
    Lightning compares the next ``self.log`` with (else it raises), for every kind of value."""
    import lightning.pytorch as pl
    import torchmetrics
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Logging(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.total = torchmetrics.SumMetric()

        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.total.update(batch.sum())
            self.log("mean", out["loss"], on_step=True, on_epoch=True, prog_bar=True)
            self.log("sum", batch.sum(), reduce_fx="sum", sync_dist=True)
            self.log("top", batch.max(), reduce_fx=max, on_step=False, on_epoch=True)
            self.log("low", batch.min(), reduce_fx="min", logger=False)
            self.log("metric", self.total, on_step=False, on_epoch=True)
            return out

    live: dict[str, object] = {}

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            live.update(lightning_compat.logger_connector_state(trainer))
            rebuilt = {}
            for key, metric in lightning_compat.training_results(trainer).items():
                entry = lightning_compat.result_entry(metric)
                if not entry["is_tensor"]:
                    entry["metric"] = pl_module.total
                rebuilt[key] = lightning_compat.new_result_metric(
                    trainer, entry, sync_dist=entry["meta"]["sync_dist"]
                )
                assert rebuilt[key].meta == metric.meta, key
                assert rebuilt[key].metric_state.keys() == metric.metric_state.keys()
            live["rebuilt"] = rebuilt

    trainer = pl.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Look()],
    )
    trainer.fit(Logging())
    assert live["first_loop_iter"] is False and live["current_fx"] == "training_step"
    assert {"mean", "mean_step", "sum", "low"} <= set(live["callback"])  # type: ignore[arg-type]
    assert set(live["rebuilt"]) == {  # type: ignore[arg-type]
        f"training_step.{name}" for name in ("mean", "sum", "top", "low", "metric")
    }
    assert not lightning_compat.is_distributed(trainer)
    assert not lightning_compat.finish_fit_loop_restart(trainer)  # not restarting
