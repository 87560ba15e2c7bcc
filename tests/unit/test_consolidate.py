"""consolidate(), load_weights() and CheckpointEngine.best() in one process, on engine
checkpoints (the Lightning side is in tests/lightning/test_native_loading.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_elastic import (
    CheckpointEngine,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointWarning,
    IntegrityError,
    LoadedWeights,
    UnsafeCheckpointError,
    WeightsMismatchError,
    consolidate,
    load_weights,
)
from lightning_elastic.core.format.manifest import QUARANTINE_FILE
from lightning_elastic.core.storage.local import LocalStorage


class Net(torch.nn.Module):
    def __init__(self, classes: int = 2, hidden: int = 8) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, hidden)
        self.head = torch.nn.Linear(hidden, classes)
        self.register_buffer("calls", torch.tensor(0))


def trained(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net.head(net.body(torch.randn(3, 4))).sum().backward()
    opt.step()
    return net, opt


def save(root: Path, steps: dict[int, int], metrics: dict[int, float] | None = None) -> dict:
    """One checkpoint per step (model ``seed``), {"model", "optim", "step"}; returns the nets."""
    nets = {}
    with CheckpointEngine(str(root)) as engine:
        for step, seed in steps.items():
            net, opt = trained(seed)
            nets[step] = net
            score = {"loss": metrics[step]} if metrics else None
            engine.save({"model": net, "optim": opt, "step": step}, step=step, metrics=score)
    return nets


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- consolidate


def test_consolidate_returns_the_saved_state_and_writes_a_file_torch_load_reads(tmp_path) -> None:
    nets = save(tmp_path / "ckpts", {3: 3})
    out = tmp_path / "model.pt"
    state = consolidate(tmp_path / "ckpts" / "step_000000003", out)
    assert sorted(state) == ["model", "optim", "step"] and state["step"] == 3
    assert same(state["model"], nets[3].state_dict())
    assert sorted(state["optim"]["state"]) == [0, 1, 2, 3]  # int keys, as saved
    loaded = torch.load(out, weights_only=True)  # plain tensors and containers: safe to load
    assert same(loaded["model"], nets[3].state_dict()) and loaded["optim"]["state"].keys() == {
        0,
        1,
        2,
        3,
    }
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_consolidate_of_a_root_reads_its_newest_valid_checkpoint(tmp_path) -> None:
    nets = save(tmp_path, {1: 1, 2: 2})
    assert same(consolidate(tmp_path)["model"], nets[2].state_dict())


def test_consolidate_of_a_root_walks_back_past_a_corrupt_newest(tmp_path) -> None:
    nets = save(tmp_path, {1: 1, 2: 2})
    flip_byte(shard(tmp_path / "step_000000002"))
    with pytest.warns(CorruptCheckpointWarning, match="step_000000002"):
        state = consolidate(tmp_path)
    assert same(state["model"], nets[1].state_dict())
    assert (tmp_path / "step_000000002" / QUARANTINE_FILE).exists()


def test_consolidate_of_a_corrupt_checkpoint_raises_and_writes_nothing(tmp_path) -> None:
    save(tmp_path, {1: 1})
    flip_byte(shard(tmp_path / "step_000000001"))
    out = tmp_path / "out.pt"
    with pytest.raises(IntegrityError, match="checksum"):
        consolidate(tmp_path / "step_000000001", out)
    assert not out.exists()


@pytest.mark.parametrize(
    ("src", "match"),
    [
        ("missing", "missing or empty"),
        ("empty", "missing or empty"),
        ("file.pt", "is a file"),
        ("other", "neither a checkpoint"),
    ],
)
def test_consolidate_says_what_a_path_is_instead(tmp_path, src, match) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.pt").write_bytes(b"x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not ours")
    with pytest.raises(CheckpointNotFoundError, match=match):
        consolidate(tmp_path / src)


def test_consolidate_refuses_a_bad_destination_before_reading(tmp_path, monkeypatch) -> None:
    save(tmp_path / "ckpts", {1: 1})
    ckpt = tmp_path / "ckpts" / "step_000000001"
    monkeypatch.setattr(
        LocalStorage, "read_into", lambda *a: pytest.fail("read before the destination check")
    )
    with pytest.raises(ConfigError, match="is a directory"):
        consolidate(ckpt, tmp_path)
    with pytest.raises(ConfigError, match="directory does not exist"):
        consolidate(ckpt, tmp_path / "no" / "such" / "out.pt")


@dataclass
class Opaque:
    """A user type outside the safe-loading allowlist."""

    value: int


def test_consolidate_loads_objects_safely_unless_trusted(tmp_path) -> None:
    with CheckpointEngine(str(tmp_path)) as engine:
        engine.save({"w": torch.ones(2), "odd": Opaque(3)}, step=1)
    with pytest.raises(UnsafeCheckpointError, match="Opaque"):
        consolidate(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trusted=True is logged
        assert consolidate(tmp_path, trusted=True)["odd"] == Opaque(3)


# ----------------------------------------------------------------------------- load_weights


def test_load_weights_fine_tunes_a_new_head(tmp_path) -> None:
    nets = save(tmp_path, {5: 5})
    model = Net(classes=7)
    head = {k: v.clone() for k, v in model.head.state_dict().items()}
    report = load_weights(model, tmp_path, ignore_keys="head.*", strict=False)
    assert isinstance(report, LoadedWeights) and report.step == 5
    assert report.checkpoint.endswith("step_000000005")
    assert report.loaded_keys == ("calls", "body.weight", "body.bias")  # the module's order
    assert report.ignored_keys == ("head.weight", "head.bias")
    assert report.missing_keys == () and report.unexpected_keys == ()
    assert same(model.body.state_dict(), nets[5].body.state_dict())
    assert same(model.head.state_dict(), head)  # the new head is left as it was


def test_ignored_keys_also_make_a_strict_load_pass(tmp_path) -> None:
    save(tmp_path, {5: 5})
    assert load_weights(Net(classes=7), tmp_path, ignore_keys=["head.*"]).missing_keys == ()


def test_strict_names_the_first_mismatch_and_loads_nothing(tmp_path) -> None:
    save(tmp_path, {5: 5})
    model = Net(classes=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsMismatchError) as info:
        load_weights(model, tmp_path)
    err = info.value
    assert (err.key, err.checkpoint_shape, err.model_shape) == ("head.weight", (2, 8), (7, 8))
    assert "'head.weight' is of shape (2, 8) in the checkpoint and of shape (7, 8)" in str(err)
    assert "ignore_keys" in str(err)
    assert same(model.state_dict(), before)


def test_a_shape_mismatch_raises_even_when_not_strict(tmp_path) -> None:
    save(tmp_path, {5: 5})
    with pytest.raises(WeightsMismatchError, match=r"head\.weight"):
        load_weights(Net(classes=7), tmp_path, strict=False)


def test_missing_and_unexpected_keys_are_reported_or_refused(tmp_path) -> None:
    nets = save(tmp_path, {5: 5})
    body_only = torch.nn.Module()
    body_only.body = torch.nn.Linear(4, 8)
    body_only.extra = torch.nn.Linear(2, 2)
    with pytest.raises(WeightsMismatchError, match=r"'extra\.weight'.*the checkpoint has no such"):
        load_weights(body_only, tmp_path)
    report = load_weights(body_only, tmp_path, strict=False)
    assert report.missing_keys == ("extra.weight", "extra.bias")
    assert report.unexpected_keys == ("calls", "head.weight", "head.bias")
    assert same(body_only.body.state_dict(), nets[5].body.state_dict())


def test_load_weights_reads_only_the_weights(tmp_path, monkeypatch) -> None:
    """Adam keeps two tensors per parameter: the optimizer's bytes are never read."""
    save(tmp_path, {5: 5})
    read = []
    real_into, real_bytes = LocalStorage.read_into, LocalStorage.read_bytes
    real_ranges = LocalStorage.read_ranges

    def read_into(self, rel, offset, out):
        read.append((rel, out.nbytes))
        return real_into(self, rel, offset, out)

    def read_bytes(self, rel, start=0, length=None):
        data = real_bytes(self, rel, start, length)
        read.append((rel, len(data)))
        return data

    def read_ranges(self, rel, ranges):
        read.extend((rel, out.nbytes) for _, out in ranges)
        return real_ranges(self, rel, ranges)

    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    monkeypatch.setattr(LocalStorage, "read_bytes", read_bytes)
    monkeypatch.setattr(LocalStorage, "read_ranges", read_ranges)
    load_weights(Net(), tmp_path)
    from_shards = sum(n for rel, n in read if rel.endswith(".distcp"))
    weights = sum(t.numel() * t.element_size() for t in Net().state_dict().values())
    assert from_shards == weights  # parameters + buffer, nothing of the optimizer
    read.clear()
    consolidate(tmp_path)
    assert sum(n for rel, n in read if rel.endswith(".distcp")) > 2 * weights


def test_load_weights_finds_the_weights_entry_or_asks_for_it(tmp_path) -> None:
    with CheckpointEngine(str(tmp_path)) as engine:
        engine.save({"student": Net(), "teacher": Net()}, step=1)
    with pytest.raises(ConfigError, match=r"neither of \['state_dict', 'model'\].*'student'"):
        load_weights(Net(), tmp_path)
    with pytest.raises(ConfigError, match="no entry 'pupil'"):
        load_weights(Net(), tmp_path, key="pupil")
    assert load_weights(Net(), tmp_path, key="teacher").missing_keys == ()


# ----------------------------------------------------------------------------- best


def test_best_ranks_by_the_recorded_metric_and_skips_a_corrupt_best(tmp_path) -> None:
    save(tmp_path, {1: 1, 2: 2, 3: 3, 4: 4}, metrics={1: 0.5, 2: 0.1, 3: 0.3, 4: 0.9})
    with CheckpointEngine(str(tmp_path)) as engine:
        assert engine.best("loss").name == "step_000000002"
        assert engine.best("loss", "max").name == "step_000000004"
        assert engine.best("accuracy") is None
        with pytest.raises(ConfigError, match="mode"):
            engine.best("loss", "lowest")
    flip_byte(shard(tmp_path / "step_000000002"))
    with CheckpointEngine(str(tmp_path)) as engine, pytest.warns(CorruptCheckpointWarning):
        assert engine.best("loss").name == "step_000000003"
