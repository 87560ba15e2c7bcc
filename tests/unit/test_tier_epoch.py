"""Job epochs of a multi-tier run's persistent root (core/tiers/epoch.py)."""

from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers.epoch import EPOCHS_DIR, claim_epoch


def test_each_claim_is_above_every_earlier_one_also_another_jobs(tmp_path) -> None:
    storage = Storage(str(tmp_path))
    assert [claim_epoch(storage) for _ in range(3)] == [1, 2, 3]
    # another job claimed epoch 4
    (tmp_path / EPOCHS_DIR / f"{4:012d}").write_bytes(b"")
    assert claim_epoch(storage) == 5
    assert sorted(p.name for p in (tmp_path / EPOCHS_DIR).iterdir())[-1] == f"{5:012d}"


def test_the_epochs_folder_is_hidden_from_checkpoint_listings(tmp_path) -> None:
    from lightning_elastic.core.format.catalog import Catalog

    storage = Storage(str(tmp_path))
    claim_epoch(storage)
    assert Catalog(storage).scan() == []
