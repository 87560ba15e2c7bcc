"""``elastic_fsdp``: FSDP2 checkpoints saved sharded, resharded N -> M bitwise, converted to and
from the DDP layouts, resumed exactly after a SIGKILL."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import fsdp_workers as w

pytestmark = pytest.mark.timeout(400)


def assert_same_state(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """Every parameter (on every rank) and optimizer state bitwise equal: full tensors by
    name; a ZeRO optimizer's state is the union of the ranks' partitions."""
    for r in after:
        assert set(r["params"]) == set(before[0]["params"])
        for name, tensor in before[0]["params"].items():
            assert torch.equal(r["params"][name], tensor), name
        assert r["lr"] == before[0]["lr"]
    expected, got = whole_optimizer_state(before), whole_optimizer_state(after)
    assert set(got) == set(expected)
    for name, states in expected.items():
        assert set(got[name]) == set(states), name
        for key, tensor in states.items():
            assert torch.equal(got[name][key], tensor), (name, key)


def whole_optimizer_state(results: list[dict[str, Any]]) -> dict[str, Any]:
    whole: dict[str, Any] = {}
    for r in results:
        if not r["partitioned"]:  # every rank holds (a view of) the whole state
            assert not whole or set(r["optim"]) == set(whole)
        whole.update(r["optim"])
    return whole


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(world, strategy, **kw)``: a run of 6 steps checkpointed at step 6 (made once
    per module), as (checkpoint directory, rank results)."""
    cache: dict[tuple, tuple[Path, list]] = {}

    def get(world: int, strategy: str = "elastic_fsdp", **kw: Any) -> tuple[Path, list]:
        key = (world, strategy, tuple(sorted(kw.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{strategy}{world}")
            results = run_distributed(
                w.fsdp_fit, world, str(root), 6, every=6, strategy=strategy, **kw
            )
            cache[key] = (root / "ckpts", results)
        return cache[key]

    return get


def resume(tmp_path: Path, source: Path, world: int, **kw: Any) -> list:
    """Resume a copy of the checkpoints of ``source`` at ``world`` ranks (no further step)."""
    shutil.copytree(source, tmp_path / "ckpts")
    results = run_distributed(w.fsdp_fit, world, str(tmp_path), 6, every=6, **kw)
    assert results[0]["resumed_from"].endswith("step_000000006")
    return results


@pytest.mark.parametrize(("saved_world", "loaded_world"), [(2, 1), (2, 3), (2, 4), (3, 2)])
def test_reshards_bitwise(tmp_path, saved, saved_world, loaded_world) -> None:
    source, before = saved(saved_world)
    total = sum(t.numel() for t in before[0]["params"].values())
    # sharded, not replicated: the ranks' shards add up to the model once
    assert sum(r["local_numel"] for r in before) == total
    after = resume(tmp_path, source, loaded_world)
    assert sum(r["local_numel"] for r in after) == total
    assert_same_state(before, after)


def test_each_rank_writes_only_its_shards(saved) -> None:
    from lightning_elastic.core.format.dcp_json import read_checkpoint_metadata
    from lightning_elastic.core.storage.base import Storage

    source, _ = saved(2)
    metadata, _ = read_checkpoint_metadata(Storage(str(source / "step_000000006")))
    tensors = metadata.state_dict_metadata
    # a parameter and its Adam moment: one chunk per rank (rows 0-14 and 15-29), not gathered
    for fqn in ("state_dict.net.0.weight", "optimizer_states.0.state.net.0.weight.exp_avg"):
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in tensors[fqn].chunks)
        assert chunks == [((0, 0), (15, 8)), ((15, 0), (15, 8))], fqn
    # replicated state is written once: the step count is one chunk of the whole tensor
    assert len(tensors["optimizer_states.0.state.net.0.weight.step"].chunks) == 1


@pytest.mark.parametrize(("first", "second"), [(2, 1), (2, 3), (3, 2)])
def test_training_continues_on_the_same_trajectory(tmp_path, first, second) -> None:
    kw = {"global_batch_size": 12, "dropout": 0.0}
    reference = run_distributed(w.fsdp_fit, 2, str(tmp_path / "ref"), 12, every=100, **kw)
    root = str(tmp_path / "run")
    run_distributed(w.fsdp_fit, first, root, 6, every=6, **kw)
    resumed = run_distributed(w.fsdp_fit, second, root, 12, every=100, **kw)
    assert resumed[0]["resumed_from"].endswith("step_000000006")
    ref = dict(reference[0]["global_losses"])
    got = dict(resumed[0]["global_losses"] if second > 1 else resumed[0]["losses"])
    assert sorted(got) == list(range(6, 12))
    for step, value in got.items():
        assert value == pytest.approx(ref[step], rel=1e-5), step


@pytest.fixture(scope="module")
def reference12(tmp_path_factory) -> list[dict[str, Any]]:
    """12 steps at 2 ranks without a checkpoint: what a killed and resumed run must match."""
    return run_distributed(w.fsdp_fit, 2, str(tmp_path_factory.mktemp("ref12")), 12, every=100)


def test_sigkill_mid_epoch_resumes_bitwise(tmp_path, reference12) -> None:
    reference = reference12
    root = str(tmp_path / "run")
    # checkpoints every 4 steps (asynchronous); every rank dies at step 9 (step 8 committed)
    run_distributed(w.fsdp_fit, 2, root, 12, every=4, kill_at=9, may_die={0, 1})
    resumed = run_distributed(w.fsdp_fit, 2, root, 12, every=4)
    assert resumed[0]["resumed_from"].endswith("step_000000008")
    for rank in range(2):
        ref = dict(reference[rank]["losses"])
        got = dict(resumed[rank]["losses"])
        assert sorted(got) == [8, 9, 10, 11]
        assert all(got[step] == ref[step] for step in got), rank  # bitwise
    assert_same_state(reference, resumed)


@pytest.mark.parametrize(
    "kw", [{}, {"strategy": "elastic", "shard": True}], ids=["fsdp2", "zero1_optimizer"]
)
def test_multi_tier_a_replaced_node_recovers_its_shards_from_the_other_node_bitwise(
    tmp_path, reference12, kw
) -> None:
    # a sharded state with a node-local tier, each rank its own node: saves at 4 and 8
    # commit locally and replicate to the other node (none persisted: every 3rd save is);
    # every rank dies at step 9 and node b comes back with an empty local dir
    reference = reference12
    if kw:
        reference = run_distributed(w.fsdp_fit, 2, str(tmp_path / "ref"), 12, every=100, **kw)
    root = tmp_path / "run"
    run_distributed(
        w.fsdp_fit, 2, str(root), 12, every=4, kill_at=9, may_die={0, 1}, nodes=True, **kw
    )
    assert not list((root / "ckpts").glob("step_*/manifest.json"))
    shutil.rmtree(root / "local" / "b")
    resumed = run_distributed(w.fsdp_fit, 2, str(root), 12, every=4, nodes=True, **kw)
    a, b = (r["recovery"] for r in resumed)
    assert a["checkpoint"] == b["checkpoint"] == "step_000000008"
    assert (a["tier"], b["tier"]) == ("local", "peer")
    assert b["bytes"]["local"] == b["bytes"]["persistent"] == 0 < b["bytes"]["peer"]
    for rank in range(2):
        ref, got = dict(reference[rank]["losses"]), dict(resumed[rank]["losses"])
        assert sorted(got) == [8, 9, 10, 11]
        assert all(got[step] == ref[step] for step in got), rank  # bitwise
    assert_same_state(reference, resumed)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (("elastic", 2, {}), ("elastic_fsdp", 2, {})),
        (("elastic", 2, {"shard": True}), ("elastic_fsdp", 3, {})),
        (("elastic_fsdp", 2, {}), ("elastic", 3, {})),
        (("elastic_fsdp", 3, {}), ("elastic", 2, {"shard": True})),
        (("elastic_fsdp", 2, {}), ("single", 1, {})),
    ],
    ids=["ddp-fsdp", "zero-fsdp3", "fsdp-ddp3", "fsdp3-zero", "fsdp-single"],
)
def test_layout_conversion(tmp_path, saved, source, target) -> None:
    strategy, world, kw = source
    checkpoints, before = saved(world, strategy, **kw)
    strategy, world, kw = target
    after = resume(tmp_path, checkpoints, world, strategy=strategy, **kw)
    assert_same_state(before, after)


def test_mixed_precision_and_frozen_parameters(tmp_path, saved) -> None:
    source, before = saved(2, mixed=True, frozen=True)
    # optimizer state only for the trainable layer; the frozen one never moved
    assert set(before[0]["optim"]) == {"net.3.weight", "net.3.bias"}
    after = resume(tmp_path, source, 3, mixed=True, frozen=True)
    assert_same_state(before, after)
    assert after[0]["params"]["net.0.weight"].dtype == torch.float32  # sharded params: fp32


def test_consolidate_to_one_file_loads_anywhere(tmp_path, saved) -> None:
    from lightning_elastic.cli import main as cli_main

    source, before = saved(3)
    target = tmp_path / "model.ckpt"
    assert cli_main(["consolidate", str(source / "step_000000006"), str(target)]) == 0
    checkpoint = torch.load(target, weights_only=False)
    optimizer = checkpoint["optimizer_states"][0]
    assert "sharded" not in optimizer and sorted(optimizer["state"]) == [0, 1, 2, 3]
    # the LightningModule loads it, or the directory itself, as a plain module (no FSDP)
    for path in (target, source / "step_000000006"):
        module = w.ShardedModule.load_from_checkpoint(path)
        for name, tensor in before[0]["params"].items():
            assert torch.equal(module.state_dict()[name], tensor), (path, name)
    # and Lightning's own single-device fit resumes from it with the optimizer state
    after = run_distributed(
        w.fsdp_fit, 1, str(tmp_path / "run"), 6, strategy="single", ckpt_path=str(target)
    )
    assert_same_state(before, after)


def test_tensor_parallel_x_fsdp_resumes_as_fsdp_only(tmp_path) -> None:
    # 2-D mesh: 2 data-parallel groups x 2 tensor-parallel ranks (ColwiseParallel, then
    # RowwiseParallel), each layer also sharded by FSDP across the data-parallel groups
    root = str(tmp_path)
    before = run_distributed(w.fsdp_fit, 4, root, 6, every=6, tensor_parallel=2)
    # the ranks of one tensor-parallel group train on the same samples
    assert before[0]["seen"] == before[1]["seen"] != before[2]["seen"] == before[3]["seen"]
    after = run_distributed(w.fsdp_fit, 2, root, 6, every=6)
    assert after[0]["resumed_from"].endswith("step_000000006")
    assert_same_state(before, after)


def test_save_checkpoint_then_validate_sharded_and_on_one_device(tmp_path) -> None:
    root = str(tmp_path)
    trained = run_distributed(w.fsdp_save_then_validate, 2, root, False)[0]["params"]
    sharded = run_distributed(w.fsdp_save_then_validate, 4, root, True)  # 8 samples each
    single = run_distributed(w.fsdp_save_then_validate, 1, root, True)
    assert sharded[0]["strategy"] == "ElasticFSDPStrategy"
    assert single[0]["strategy"] == "SingleDeviceStrategy"
    # both evaluated the saved weights: the loss computed here from them
    from tests.lightning.models import IdDataset

    module = w.ShardedModule(hidden=30, dropout=0.0)
    module.load_state_dict(trained, strict=False)
    data = IdDataset(32)
    expected = torch.nn.functional.mse_loss(module.net(data.x), data.y).item()
    assert sharded[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert single[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_sigterm_on_one_rank_checkpoints_the_shards_and_resumes(tmp_path) -> None:
    import signal

    root = str(tmp_path)
    stopped = run_distributed(w.fsdp_fit, 2, root, 50, every=100, signal_at=5)
    assert [r["exit"] for r in stopped] == [128 + signal.SIGTERM] * 2
    assert {r["global_step"] for r in stopped} == {6}  # the same step boundary on both ranks
    resumed = run_distributed(w.fsdp_fit, 2, root, 8, every=100)
    assert resumed[0]["resumed_from"].endswith("step_000000006")
    assert sorted(dict(resumed[0]["losses"])) == [6, 7]


@pytest.mark.parametrize("loaded_world", [2, 3])
def test_a_parameter_without_gradients_resumes(tmp_path, saved, loaded_world) -> None:
    # the optimizer holds a layer that never had a gradient: no state saved for it, and none
    # after the resume either (not the zero-lr step's placeholder)
    source, before = saved(2, unused=True)
    assert "aux.weight" not in before[0]["optim"] and "net.3.weight" in before[0]["optim"]
    after = resume(tmp_path, source, loaded_world, unused=True)
    assert_same_state(before, after)


def test_a_save_before_the_first_step_changes_nothing(tmp_path) -> None:
    kw = {"every": 100, "dropout": 0.0}
    plain = run_distributed(w.fsdp_fit, 2, str(tmp_path / "plain"), 4, **kw)
    saving = run_distributed(w.fsdp_fit, 2, str(tmp_path / "saving"), 4, save_at_start=True, **kw)
    assert saving[0]["losses"] == plain[0]["losses"]  # no phantom optimizer step
    assert_same_state(plain, saving)
    # that checkpoint holds the groups only, and resumes to the same training
    resumed = run_distributed(
        w.fsdp_fit, 3, str(tmp_path / "resumed"), 0, ckpt_path=str(tmp_path / "saving/at_start")
    )
    assert resumed[0]["optim"] == {}
