"""The throttled:// filesystem the tier benchmark uses as its object store: bandwidth per
process and direction, latency per round trip, and a Storage that works on it."""

from __future__ import annotations

import threading
import time

import pytest

import lightning_elastic.testing.throttled  # noqa: F401  (registers throttled://)
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.testing.throttled import ThrottledFileSystem, TokenBucket

MB = 10**6
PAYLOAD = bytes(range(256)) * (2 * MB // 256)  # 2 MB


def timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_two_megabytes_at_twenty_megabytes_per_second_take_a_tenth_of_a_second_each_way(
    tmp_path,
) -> None:
    fs = ThrottledFileSystem(bandwidth=20 * MB, latency=0.0)
    path = str(tmp_path / "f.bin")

    def write() -> None:
        with fs.open(path, "wb") as f:
            for start in range(0, len(PAYLOAD), MB // 2):
                f.write(PAYLOAD[start : start + MB // 2])

    def read() -> bytes:
        with fs.open(path, "rb") as f:
            return bytes(f.read())

    _, wrote = timed(write)
    data, read_s = timed(read)
    ranged, cat_s = timed(lambda: fs.cat_file(path, start=0, end=len(PAYLOAD)))
    assert data == ranged == PAYLOAD
    for seconds in (wrote, read_s, cat_s):
        assert 0.08 <= seconds <= 0.5


def test_every_round_trip_pays_the_latency(tmp_path) -> None:
    (tmp_path / "f.bin").write_bytes(b"x")
    fs = ThrottledFileSystem(latency=0.05)
    path = str(tmp_path / "f.bin")
    for op in (
        lambda: fs.exists(path),
        lambda: fs.info(path),
        lambda: fs.ls(str(tmp_path)),
        lambda: fs.open(path, "rb").close(),
        lambda: fs.cat_file(path),
    ):
        _, seconds = timed(op)
        assert 0.045 <= seconds <= 0.5
    _, seconds = timed(lambda: fs.rm_file(path))
    assert seconds >= 0.045 and not (tmp_path / "f.bin").exists()


def test_two_instances_in_two_threads_share_one_rate_per_process(tmp_path) -> None:
    paths = [str(tmp_path / f"{i}.bin") for i in range(2)]

    def write(path: str) -> None:
        with ThrottledFileSystem(bandwidth=10 * MB, latency=0.0).open(path, "wb") as f:
            f.write(PAYLOAD[: MB // 2])
            f.write(PAYLOAD[MB // 2 : MB])

    threads = [threading.Thread(target=write, args=(p,)) for p in paths]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.18 <= time.perf_counter() - t0 <= 0.8  # 2 MB at 10 MB/s, not 1 MB twice at once
    assert TokenBucket(MB).take(0) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        ThrottledFileSystem(bandwidth=0)


def test_a_storage_on_throttled_urls_writes_lists_reads_and_deletes(tmp_path) -> None:
    storage = Storage(
        f"throttled://{tmp_path}/root",
        storage_options={"bandwidth": 50 * MB, "latency": 0.001},
    )
    assert isinstance(storage.fs, ThrottledFileSystem)
    written = storage.write_bytes("step_1/f.bin", PAYLOAD, exclusive=True)
    assert written.size == len(PAYLOAD)
    assert [e.name for e in storage.listdir("step_1")] == ["f.bin"]
    assert storage.read_bytes("step_1/f.bin", 10, 5) == PAYLOAD[10:15]
    assert (tmp_path / "root/step_1/f.bin").read_bytes() == PAYLOAD
    storage.delete("step_1/f.bin")
    assert not storage.exists("step_1/f.bin")
