"""Incremental saves in one process: unchanged tensors are referred to, not rewritten; every
checkpoint of a chain loads bitwise; references are verified, followed and kept."""

import copy
import threading
import warnings
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from lightning_elastic import (
    CheckpointEngine,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointWarning,
    KeepLastN,
    RetryPolicy,
    Storage,
    cli,
)
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.policy.housekeeping import delete_checkpoint
from lightning_elastic.core.save.snapshot import LazySnapshot
from lightning_elastic.testing.faults import Fault, FaultyFileSystem

NO_RETRY = RetryPolicy(deadline_s=0.5, initial_backoff_s=0.01, max_backoff_s=0.01)


class FineTune:
    """A frozen base with a small trainable head and its AdamW state: the fine-tuning shape."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.base = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 256))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.head = torch.nn.Linear(256, 4)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=0.01)

    def step(self) -> None:
        self.head(self.base(torch.randn(8, 64))).sum().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        return {
            "base": self.base.state_dict(),
            "head": self.head.state_dict(),
            "opt": self.opt.state_dict(),
        }


def manifest_of(root: Path, name: str) -> Manifest:
    return Manifest.from_json((root / name / MANIFEST_FILE).read_bytes(), name)


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def save_chain(root: Path, steps: int, *, every: int, blocking: bool = False, **kw) -> list:
    """Train and save ``steps`` times; the saved states (deep copies) and results."""
    model = FineTune()
    saved = []
    with CheckpointEngine(root, full_every_n_saves=every, **kw) as eng:
        for step in range(1, steps + 1):
            model.step()
            state = model.state()
            handle = eng.save(state, step=step, blocking=blocking)
            saved.append((copy.deepcopy(state), handle.result()))
    return saved


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "sync"])
def test_a_frozen_base_is_written_once_and_only_the_trainable_part_after(
    tmp_path: Path, blocking: bool
) -> None:
    saved = save_chain(tmp_path, 3, every=8, blocking=blocking)
    full, *increments = [r for _, r in saved]
    base_bytes = sum(p.numel() * 4 for p in FineTune().base.parameters())
    assert full.bytes_written > base_bytes
    for r in increments:
        assert r.bytes_written < 0.1 * full.bytes_written, r.bytes_written
        m = manifest_of(tmp_path, r.name)
        assert m.format_version == 3
        assert m.referenced_checkpoints == {full.name}
        assert m.referenced_bytes == manifest_of(tmp_path, full.name).files[0].size
    assert not manifest_of(tmp_path, full.name).references


def test_every_checkpoint_of_a_chain_loads_bitwise(tmp_path: Path) -> None:
    saved = save_chain(tmp_path, 5, every=3)
    with CheckpointEngine(tmp_path) as eng:
        for state, result in saved:
            loaded = eng.load(checkpoint=result.name).state
            assert_same(state, loaded, result.name)
        fresh = FineTune(seed=7)
        fresh.step()  # optimizer state to load into
        into = fresh.state()
        eng.load(into)  # in place, the newest
    assert_same(saved[-1][0], into)


def test_full_every_n_saves_bounds_the_chain(tmp_path: Path) -> None:
    saved = save_chain(tmp_path, 7, every=3)
    names = [r.name for _, r in saved]
    refs = [manifest_of(tmp_path, n).referenced_checkpoints for n in names]
    # saves 1, 4, 7 are full; the others refer to their chain's full save only
    assert refs == [set(), {names[0]}, {names[0]}, set(), {names[3]}, {names[3]}, set()]


def test_a_tensor_changed_behind_its_version_counter_is_written_not_referred_to(
    tmp_path: Path,
) -> None:
    model = FineTune()
    with CheckpointEngine(tmp_path, full_every_n_saves=4) as eng:
        eng.save(model.state(), step=1).result()
        weight = model.base[0].weight
        version = weight._version
        weight.data[3, 5] += 1.0  # .data: no version bump, same storage
        assert weight._version == version
        changed = copy.deepcopy(model.state())
        second = eng.save(model.state(), step=2).result()
        loaded = eng.load(checkpoint=second.name).state
    assert_same(changed, loaded)
    assert second.bytes_written > weight.numel() * 4  # that tensor was written again


def test_a_lazily_staged_tensor_is_held_with_the_digest_of_the_bytes_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the save point hashed a host tensor changed behind its counter (digest kept for the
    # next save), then the lazy copy staged other bytes (a .data change in its window, which
    # the copy cannot see): the next save, back at the save point's bytes, referred to the
    # file holding the copy's bytes and loaded them
    gate = threading.Event()
    run = LazySnapshot.run

    def held(self: LazySnapshot) -> None:
        assert gate.wait(30)
        run(self)

    monkeypatch.setattr(LazySnapshot, "run", held)
    model = FineTune()
    weight = model.base[0].weight
    with CheckpointEngine(tmp_path, full_every_n_saves=8, snapshot="lazy") as eng:
        gate.set()
        eng.save(model.state(), step=1).result()
        gate.clear()
        weight.data[0, 0] = 5.0  # behind the counter: hashed at the save point
        handle = eng.save(model.state(), step=2)
        weight.data[0, 0] = 7.0  # in the lazy window: step 2 holds 7 (documented)
        gate.set()
        handle.result()
        weight.data[0, 0] = 5.0
        expected = copy.deepcopy(model.state())
        third = eng.save(model.state(), step=3).result()
        assert_same(expected, eng.load(checkpoint=third.name, adopt_run=False).state)


def test_a_corrupt_referenced_file_quarantines_the_referrer_and_resume_falls_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = save_chain(tmp_path, 4, every=2)  # 1 full, 2 -> 1, 3 full, 4 -> 3
    names = [r.name for _, r in saved]
    third = manifest_of(tmp_path, names[2])
    shard = next(f.path for f in third.files if f.rank == 0)
    path = tmp_path / names[2] / shard
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert cli.main(["verify", str(tmp_path / names[3])]) != 0
    out = capsys.readouterr().out
    assert f"{names[2]}/{shard}" in out  # the referenced file is named with its checkpoint
    with CheckpointEngine(tmp_path) as eng, pytest.warns(CorruptCheckpointWarning, match=shard):
        result = eng.load()
    assert result.info.name == names[1]  # 4 and 3 are corrupt: 2 (-> 1) is the newest good
    assert_same(saved[1][0], result.state)


def test_a_missing_referenced_file_is_found_by_a_size_check(tmp_path: Path) -> None:
    saved = save_chain(tmp_path, 2, every=4)
    first = manifest_of(tmp_path, saved[0][1].name)
    (tmp_path / first.name / next(f.path for f in first.files if f.rank == 0)).unlink()
    with CheckpointEngine(tmp_path) as eng, warnings.catch_warnings():
        warnings.simplefilter("ignore", CorruptCheckpointWarning)
        with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint"):
            eng.load(verify="size")


def test_retention_keeps_the_checkpoint_a_kept_one_refers_to(tmp_path: Path) -> None:
    saved = save_chain(tmp_path, 5, every=3, retention=[KeepLastN(1)])
    names = [r.name for _, r in saved]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert left == [names[3], names[4]]  # 5 refers to 4 (full): both stay, 1-3 are gone
    with CheckpointEngine(tmp_path) as eng:
        assert_same(saved[-1][0], eng.load().state)


def test_retention_deletes_a_doomed_base_together_with_its_doomed_referrers(
    tmp_path: Path,
) -> None:
    # after save 4 (full) retention dooms 1 and 3 (3 refers to 1): deleted oldest first, 1
    # was kept because 3 still referred to it, and lingered after the fit ended
    saved = save_chain(tmp_path, 4, every=3, retention=[KeepLastN(1)])
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert left == [saved[3][1].name]


def test_prune_deletes_a_chain_it_dooms_and_reports_only_what_it_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = save_chain(tmp_path, 5, every=3)
    names = [r.name for _, r in saved]
    capsys.readouterr()
    assert cli.main(["prune", str(tmp_path), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert left == [names[3], names[4]]  # 5 refers to 4
    assert "3 checkpoint(s) deleted" in out, out
    # a base a kept (here: corrupt, not among the valid ones prune plans over) checkpoint
    # still refers to is not reported deleted
    more = save_chain(tmp_path / "more", 3, every=2)  # 2 refers to 1; 3 is full
    shard = manifest_of(tmp_path / "more", more[1][1].name).files[0].path
    with open(tmp_path / "more" / more[1][1].name / shard, "ab") as f:
        f.write(b"x")  # 2 is corrupt (its own file), and still refers to 1
    capsys.readouterr()
    cli.main(["prune", str(tmp_path / "more"), "--keep-last", "1", "--json"])
    out = capsys.readouterr().out
    assert (tmp_path / "more" / more[0][1].name / MANIFEST_FILE).exists()
    assert more[0][1].name not in out.split('"deleted"')[1].split('"failed"')[0], out


def test_a_save_that_replaces_a_named_checkpoint_is_full(tmp_path: Path) -> None:
    # it referred to the files of the checkpoint it replaced: a manifest naming itself
    # (malformed), whose referenced files the commit's cleanup removed as strays
    model = FineTune()
    with CheckpointEngine(tmp_path, full_every_n_saves=4) as eng:
        for step in (1, 2, 3):
            model.step()
            expected = copy.deepcopy(model.state())
            eng.save(model.state(), step=step, name="latest", overwrite=True).result()
            assert not manifest_of(tmp_path, "latest").references
        assert_same(expected, eng.load(checkpoint="latest", adopt_run=False).state)
        # nor is it a base: a checkpoint referring to it would forbid its next replacement
        # (a ModelCheckpoint's "last" in the callback's root: the same engine)
        eng.save(model.state(), step=4, name="latest", overwrite=True).result()
        fifth = eng.save(model.state(), step=5).result()
        assert "latest" not in manifest_of(tmp_path, fifth.name).referenced_checkpoints
        eng.save(model.state(), step=6, name="latest", overwrite=True).result()


def test_a_checkpoint_another_refers_to_is_not_overwritten(tmp_path: Path) -> None:
    # replacing it removed the files the referrer reads: the referrer was corrupt
    model = FineTune()
    with CheckpointEngine(tmp_path, full_every_n_saves=4) as eng:
        eng.save(model.state(), step=1, name="a").result()
        model.step()
        expected = copy.deepcopy(model.state())
        eng.save(model.state(), step=2, name="b").result()
        assert manifest_of(tmp_path, "b").referenced_checkpoints == {"a"}
        with pytest.raises(CheckpointExistsError, match="b refer"):
            eng.save(model.state(), step=3, name="a", overwrite=True)
        assert_same(expected, eng.load(checkpoint="b", adopt_run=False).state)


def test_a_writer_that_takes_the_run_back_saves_full(tmp_path: Path) -> None:
    # replica groups hand the run back and forth (take_over(renew=True)); the other writer's
    # retention deleted this one's last chain, which its next save still referred to
    model = FineTune()
    with (
        CheckpointEngine(tmp_path, run_id="r", full_every_n_saves=8) as first,
        CheckpointEngine(tmp_path, run_id="r", retention=[KeepLastN(1)]) as second,
    ):
        first.save(model.state(), step=1).result()
        first.save(model.state(), step=2).result()
        second.take_over(renew=True)
        second.save(model.state(), step=3).result()  # deletes 1 and 2
        first.take_over(renew=True)
        model.step()
        expected = copy.deepcopy(model.state())
        fourth = first.save(model.state(), step=4).result()
        assert not manifest_of(tmp_path, fourth.name).references
        assert_same(expected, first.load(checkpoint=fourth.name, adopt_run=False).state)


def test_deleting_a_referenced_checkpoint_directly_leaves_it(tmp_path: Path) -> None:
    saved = save_chain(tmp_path, 2, every=4)
    storage = Storage(str(tmp_path))
    delete_checkpoint(storage, Catalog(storage), saved[0][1].name)
    assert (tmp_path / saved[0][1].name / MANIFEST_FILE).exists()
    delete_checkpoint(storage, Catalog(storage), saved[1][1].name)  # the referrer goes first
    delete_checkpoint(storage, Catalog(storage), saved[0][1].name)
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_a_failed_save_makes_the_next_one_full(tmp_path: Path) -> None:
    faults = [Fault("write", "*dcp_metadata.json", "EACCES", skip=1)]  # the 2nd commit fails
    storage = Storage(tmp_path, fs=FaultyFileSystem(LocalFileSystem(), faults), retry=NO_RETRY)
    model = FineTune()
    with CheckpointEngine(storage=storage, full_every_n_saves=8) as eng:
        eng.save(model.state(), step=1, blocking=True)
        with pytest.raises(CheckpointSaveError):
            eng.save(model.state(), step=2, blocking=True)
        third = eng.save(model.state(), step=3, blocking=True).result()
    assert not manifest_of(tmp_path, third.name).references


def test_a_load_makes_the_next_save_full(tmp_path: Path) -> None:
    saved = save_chain(tmp_path, 2, every=8)
    model = FineTune()
    with CheckpointEngine(tmp_path, full_every_n_saves=8) as eng:
        state = model.state()
        eng.load(state)
        after = eng.save(state, step=3).result()
        again = eng.save(state, step=4).result()
    assert not manifest_of(tmp_path, after.name).references
    assert manifest_of(tmp_path, again.name).referenced_checkpoints == {after.name}
    assert saved


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", True])
def test_full_every_n_saves_takes_a_positive_count(tmp_path: Path, bad) -> None:
    with pytest.raises(ConfigError, match="full_every_n_saves"):
        CheckpointEngine(tmp_path, full_every_n_saves=bad)


def test_with_compression_references_keep_their_frames(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    saved = save_chain(tmp_path, 3, every=4, compression="zstd")
    assert manifest_of(tmp_path, saved[2][1].name).references
    with CheckpointEngine(tmp_path) as eng:
        assert_same(saved[2][0], eng.load().state)


def test_incremental_saves_are_refused_with_a_node_local_tier(tmp_path: Path) -> None:
    # the tiers' replicas, uploads and recovery copy a checkpoint's own files only
    with pytest.raises(ConfigError, match=r"full_every_n_saves=4 .* local_root"):
        CheckpointEngine(tmp_path / "p", local_root=tmp_path / "l", full_every_n_saves=4)
