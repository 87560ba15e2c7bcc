"""``ElasticCheckpointIO`` in ``Fabric(plugins=[...])``: ``fabric.save``/``fabric.load`` commit,
verify and save asynchronously; a 2-process loop SIGKILLed mid-save leaves the previous
checkpoint, which loads at another world size (one launch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_elastic import ElasticCheckpointIO, IntegrityError, Storage
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.testing.spawn import run_distributed
from tests.fabric import workers

pytestmark = pytest.mark.timeout(300)


def one_process() -> tuple[Fabric, ElasticCheckpointIO]:
    io = ElasticCheckpointIO()
    return Fabric(accelerator="cpu", devices=1, plugins=[io]), io


def assert_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_fabric_save_commits_and_fabric_load_restores_model_optimizer_and_values(
    tmp_path: Path,
) -> None:
    fabric, io = one_process()
    state = workers.make_state(fabric)
    for _ in range(3):
        workers.train_step(fabric, state)
    fabric.save(tmp_path / "ckpt", {**state, "note": "three steps"})
    io.wait()
    assert (tmp_path / "ckpt" / MANIFEST_FILE).is_file()
    fresh = workers.make_state(fabric)
    rest = fabric.load(tmp_path / "ckpt", fresh)
    assert rest == {"note": "three steps"} and fresh["step"] == 3
    assert_weights(workers.weights(fresh), workers.weights(state))
    saved, loaded = state["optimizer"].state_dict(), fresh["optimizer"].state_dict()
    assert all(
        torch.equal(saved["state"][p]["exp_avg"], loaded["state"][p]["exp_avg"])
        for p in saved["state"]
    )
    workers.train_step(fabric, state)  # a second save of the name replaces the first
    fabric.save(tmp_path / "ckpt", state)
    assert fabric.load(tmp_path / "ckpt")["step"] == 4  # waits for that save's commit
    io.teardown()


def test_fabric_load_of_a_corrupt_checkpoint_names_the_file(tmp_path: Path) -> None:
    fabric, io = one_process()
    state = workers.make_state(fabric)
    fabric.save(tmp_path / "ckpt", state)
    io.wait()
    (shard,) = (tmp_path / "ckpt").glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=shard.name):
        fabric.load(tmp_path / "ckpt", workers.make_state(fabric))


@pytest.fixture(scope="module")
def killed_loop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], Any]:
    root = tmp_path_factory.mktemp("fabric")
    fabric, io = one_process()  # the start, saved by one process
    state = workers.make_state(fabric)
    for _ in range(2):
        workers.train_step(fabric, state)
    fabric.save(root / "start.ckpt", state)
    io.teardown()
    results = run_distributed(
        workers.train_and_die_mid_save,
        2,
        str(root),
        str(root / "start.ckpt"),
        timeout=180,
        may_die=(0,),
        pg_timeout=30,
    )
    return root, results, workers.weights(state)


@pytest.mark.slow
def test_two_processes_load_a_one_process_checkpoint(killed_loop) -> None:
    _, (rank0, rank1), start = killed_loop
    assert rank0 is None  # SIGKILLed
    assert rank1["loaded_step"] == 2
    assert "closed by peer" in rank1["error"] or "Connection" in rank1["error"]
    assert_weights(rank1["loaded"], start)


@pytest.mark.slow
def test_a_sigkill_mid_save_leaves_the_previous_checkpoint_which_loads_at_another_world_size(
    killed_loop,
) -> None:
    root, _, _ = killed_loop
    directory = root / "last.ckpt"
    # the killed save's shard is there beside the committed one's, its manifest never came
    assert len(list(directory.glob("*.distcp"))) == 2
    info = Catalog(Storage(root)).info("last.ckpt")
    expected = torch.load(root / "expected.pt")
    assert str(info.status) == "valid" and info.step == expected["step"] == 3
    fabric, io = one_process()  # world size 1 now
    state = workers.make_state(fabric)
    fabric.load(directory, state)
    assert state["step"] == 3
    assert_weights(workers.weights(state), expected["weights"])
    # the next save replaces it and the crashed save's leftovers go with its commit
    fabric.save(directory, state)
    io.teardown()
    assert len(list(directory.glob("*.distcp"))) == 1
