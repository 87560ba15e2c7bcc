"""Checkpoint files moved between ranks (core/tiers/transfer.py), each rank with its own
directory standing for its node-local storage; gloo on CPU, 2-3 processes."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from lightning_elastic import Storage
from lightning_elastic.core.storage.checksum import new_hasher
from lightning_elastic.core.tiers import (
    Transfer,
    TransferError,
    TransferIntegrityError,
    TransferStats,
    execute_transfers,
)
from lightning_elastic.core.tiers.transfer import TransferFailure
from lightning_elastic.errors import ConfigError, IntegrityError
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed import tier_workers


def data(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed * 7 + i // 251) % 256 for i in range(n))


def move(src: int, dst: int, path: str, content: bytes) -> Transfer:
    hasher = new_hasher("xxh3_64")
    hasher.update(content)
    return Transfer(src, dst, path, len(content), hasher.hexdigest())


def on_node(root: Path, rank: int, path: str) -> Path:
    return root / f"node{rank}" / path


def run(root: Path, world: int, files: dict, transfers: list, **kwargs) -> list[dict]:
    return run_distributed(
        tier_workers.transfer_worker, world, str(root), files, transfers, timeout=90, **kwargs
    )


def leftovers(root: Path) -> list[str]:
    """Temporary files a failed write left behind anywhere."""
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name]


# ----------------------------------------------------------------------------- one process


def test_an_invalid_transfer_list_is_refused_before_anything_is_sent(tmp_path) -> None:
    storage = Storage(str(tmp_path))
    for bad in (
        Transfer(1, 1, "a/b", 1, "00"),
        Transfer(0, -1, "a/b", 1, "00"),
        Transfer(0, 1, "../escape", 1, "00"),
        Transfer(0, 1, "a/b", -1, "00"),
        Transfer(0, 1, "a/b", 1, "00", algorithm="md4"),
    ):
        with pytest.raises(ConfigError):
            execute_transfers([bad], rank=0, group=None, storage=storage)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        execute_transfers([], rank=0, group=None, storage=storage, chunk_bytes=0)


def test_a_rank_named_in_no_transfer_returns_at_once_without_a_group(tmp_path) -> None:
    stats = execute_transfers(
        [Transfer(1, 2, "a/b", 1, "00")], rank=0, group=None, storage=Storage(str(tmp_path))
    )
    assert stats == TransferStats(seconds=stats.seconds)


def test_transfer_errors_pickle_and_an_integrity_one_is_an_integrity_error() -> None:
    t = Transfer(1, 0, "step_1/x.distcp", 3, "ab")
    failure = TransferFailure(t, "integrity", "rank 0: bytes differ")
    err = pickle.loads(pickle.dumps(TransferIntegrityError([failure], TransferStats())))
    assert isinstance(err, IntegrityError) and isinstance(err, TransferError)
    assert err.failures == (failure,) and err.file == "step_1/x.distcp"
    assert "from rank 1 to rank 0" in str(err) and "bytes differ" in str(err)


# ----------------------------------------------------------------------------- distributed


@pytest.mark.timeout(120)
def test_a_three_rank_cycle_and_a_swap_complete_in_list_order(tmp_path) -> None:
    a, b, c = data(5000, 0), data(3000, 1), data(4097, 2)
    files = {0: {"s/a": a, "s/ab": a}, 1: {"s/b": b, "s/ba": b}, 2: {"s/c": c}}
    transfers = [
        move(0, 1, "s/a", a),
        move(1, 2, "s/b", b),
        move(2, 0, "s/c", c),
        move(0, 1, "s/ab", a),
        move(1, 0, "s/ba", b),
    ]
    results = run(tmp_path, 3, files, transfers, chunk_bytes=1000)
    assert [r["error"] for r in results] == [None] * 3
    assert on_node(tmp_path, 1, "s/a").read_bytes() == a
    assert on_node(tmp_path, 2, "s/b").read_bytes() == b
    assert on_node(tmp_path, 0, "s/c").read_bytes() == c
    assert on_node(tmp_path, 1, "s/ab").read_bytes() == a
    assert on_node(tmp_path, 0, "s/ba").read_bytes() == b
    s0 = results[0]["stats"]
    assert (s0.files_sent, s0.bytes_sent) == (2, 10000)
    assert (s0.files_received, s0.bytes_received) == (2, 7097)
    assert results[2]["stats"].files_received == 1 and results[2]["stats"].files_sent == 1


@pytest.mark.timeout(120)
def test_a_rank_sends_while_it_receives(tmp_path) -> None:
    """Both directions at once: rank 1's write of what rank 0 sends it (the first transfer)
    waits until rank 1 has sent its own file to rank 0 (the second); one transfer after the
    other, it would wait for ever (here: fail after 20 s)."""
    a, b = data(6000, 4), data(7000, 5)
    files = {0: {"s/a": a}, 1: {"s/b": b}}
    transfers = [move(0, 1, "s/a", a), move(1, 0, "s/b", b)]
    results = run(
        tmp_path, 2, files, transfers, chunk_bytes=1000, write_after_sent=(1, "s/a", "s/b")
    )
    assert [r["error"] for r in results] == [None, None]
    assert on_node(tmp_path, 1, "s/a").read_bytes() == a
    assert on_node(tmp_path, 0, "s/b").read_bytes() == b
    assert all(r["seconds"] < 15 for r in results)


@pytest.mark.timeout(120)
def test_a_file_of_many_chunks_and_an_empty_file_arrive_whole(tmp_path) -> None:
    big, empty = data(10_000, 3), b""
    files = {0: {"s/big": big, "s/empty": empty}}
    transfers = [move(0, 1, "s/big", big), move(0, 1, "s/empty", empty)]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=768)  # 14 chunks, last short
    assert [r["error"] for r in results] == [None, None]
    assert on_node(tmp_path, 1, "s/big").read_bytes() == big
    assert on_node(tmp_path, 1, "s/empty").read_bytes() == b""
    assert results[1]["stats"].bytes_received == 10_000
    assert results[1]["stats"].files_received == 2
    # one receive buffer of chunk_bytes: big's 14 payloads + headers, not one message per byte
    assert results[1]["messages"]["recv"] == 14 + 15 + 1
    assert not leftovers(tmp_path)


@pytest.mark.timeout(120)
def test_a_file_missing_at_the_sender_fails_both_sides_at_once_and_later_transfers_go_on(
    tmp_path,
) -> None:
    ok = data(2000, 4)
    files = {0: {"s/ok": ok}}
    transfers = [move(0, 1, "s/missing", data(100, 5)), move(0, 1, "s/ok", ok)]
    results = run(tmp_path, 2, files, transfers, timeout_s=30)
    sender, receiver = results[0]["error"], results[1]["error"]
    for err in (sender, receiver):
        assert type(err) is TransferError
        assert [(f.transfer.path, f.kind) for f in err.failures] == [("s/missing", "source")]
        assert "'s/missing' from rank 0 to rank 1" in str(err) and "rank 0:" in str(err)
        assert "missing" in str(err)
    assert all(r["seconds"] < 10 for r in results), "nobody waited for the 30 s timeout"
    assert on_node(tmp_path, 1, "s/ok").read_bytes() == ok
    assert not on_node(tmp_path, 1, "s/missing").exists()
    assert results[1]["error"].stats.files_received == 1


@pytest.mark.timeout(120)
def test_a_sender_copy_of_the_wrong_size_or_damaged_is_refused_by_the_sender(tmp_path) -> None:
    good = data(3000, 6)
    damaged = bytearray(good)
    damaged[1500] ^= 1
    files = {0: {"s/short": good[:2999], "s/damaged": bytes(damaged)}}
    transfers = [move(0, 1, "s/short", good), move(0, 1, "s/damaged", good)]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000)
    for r in results:
        kinds = [(f.transfer.path, f.kind) for f in r["error"].failures]
        assert kinds == [("s/short", "source"), ("s/damaged", "integrity")]
        assert "2999 bytes" in str(r["error"]) and "does not match its checksum" in str(r["error"])
    assert not on_node(tmp_path, 1, "s/short").exists()
    assert not on_node(tmp_path, 1, "s/damaged").exists()
    assert not leftovers(tmp_path)


@pytest.mark.timeout(120)
def test_bytes_sent_from_memory_are_checked_by_the_receiver_not_read_from_the_sender_file(
    tmp_path,
) -> None:
    """A save's replica goes out from its staged payload: the sender's file is neither read
    nor hashed (here it is damaged, or absent), the receiver's checksum is the only check."""
    good = data(3000, 8)
    damaged = bytearray(good)
    damaged[10] ^= 1
    files = {0: {"s/from-memory": bytes(damaged)}}
    memory = {
        0: {
            # writable pieces go out as they are, a read-only one (padding) through scratch
            "s/from-memory": [bytearray(good[:1200]), good[1200:1300], bytearray(good[1300:])],
            "s/absent-on-disk": [bytearray(good)],
            "s/too-short": [bytearray(good[:2999])],
            "s/too-long": [bytearray(good + b"x")],
            "s/wrong-bytes": [damaged],
        }
    }
    transfers = [
        move(0, 1, p, good)
        for p in ("s/from-memory", "s/absent-on-disk", "s/too-short", "s/too-long", "s/wrong-bytes")
    ]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000, memory=memory)
    for r in results:
        kinds = [(f.transfer.path, f.kind) for f in r["error"].failures]
        assert kinds == [
            ("s/too-short", "source"),
            ("s/too-long", "source"),
            ("s/wrong-bytes", "integrity"),
        ]
        assert "in memory has 2999 bytes" in str(r["error"])
    assert on_node(tmp_path, 1, "s/from-memory").read_bytes() == good
    assert on_node(tmp_path, 1, "s/absent-on-disk").read_bytes() == good
    for path in ("s/too-short", "s/too-long", "s/wrong-bytes"):
        assert not on_node(tmp_path, 1, path).exists()
    assert results[0]["stats"].files_sent == 2
    assert not leftovers(tmp_path)


@pytest.mark.timeout(120)
def test_bytes_damaged_in_flight_fail_both_sides_and_leave_no_copy(tmp_path) -> None:
    content = data(4000, 7)
    files = {0: {"s/x": content}}
    results = run(tmp_path, 2, files, [move(0, 1, "s/x", content)], flip_on_rank=1)
    for r in results:
        err = r["error"]
        assert isinstance(err, TransferIntegrityError) and isinstance(err, IntegrityError)
        assert err.file == "s/x" and "the received copy was deleted" in str(err)
    assert results[0]["stats"].files_sent == 0
    assert not on_node(tmp_path, 1, "s/x").exists()
    assert not leftovers(tmp_path)


@pytest.mark.timeout(120)
def test_a_retry_skips_files_already_present_and_replaces_a_damaged_copy(tmp_path) -> None:
    kept, redo = data(50_000, 8), data(3000, 9)
    damaged = bytearray(redo)
    damaged[0] ^= 1
    files = {0: {"s/kept": kept, "s/redo": redo}, 1: {"s/kept": kept, "s/redo": bytes(damaged)}}
    transfers = [move(0, 1, "s/kept", kept), move(0, 1, "s/redo", redo)]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000)
    assert [r["error"] for r in results] == [None, None]
    sender, receiver = results[0]["stats"], results[1]["stats"]
    assert sender.files_present == receiver.files_present == 1
    assert (sender.files_sent, sender.bytes_sent) == (1, 3000)
    assert on_node(tmp_path, 1, "s/redo").read_bytes() == redo
    # the present file cost the sender one message (the receiver's "no"), not 50 chunks
    assert results[0]["messages"] == {"send": 3 * 2 + 1, "recv": 1 + 1 + 1}


@pytest.mark.timeout(120)
def test_a_rank_with_nothing_to_do_returns_while_the_others_transfer(tmp_path) -> None:
    content = data(2000, 10)
    results = run(tmp_path, 3, {0: {"s/x": content}}, [move(0, 1, "s/x", content)])
    assert results[2]["stats"] == TransferStats(seconds=results[2]["stats"].seconds)
    assert results[2]["messages"] == {"send": 0, "recv": 0}
    assert on_node(tmp_path, 1, "s/x").read_bytes() == content


@pytest.mark.timeout(120)
def test_a_dead_peer_fails_its_transfers_by_timeout_and_the_others_still_happen(
    tmp_path,
) -> None:
    one, two = data(1000, 11), data(1000, 12)
    files = {1: {"s/one": one}, 2: {"s/two": two}}
    transfers = [move(1, 0, "s/one", one), move(2, 0, "s/two", two), move(1, 0, "s/again", one)]
    results = run(tmp_path, 3, files, transfers, timeout_s=5, exit_on_rank=1, may_die=[1])
    err = results[0]["error"]
    assert [(f.transfer.path, f.kind) for f in err.failures] == [
        ("s/one", "communication"),
        ("s/again", "communication"),
    ]
    assert "rank 1" in str(err) and "broke earlier" in str(err)
    assert results[2]["error"] is None and on_node(tmp_path, 0, "s/two").read_bytes() == two
    assert results[0]["seconds"] < 20
    assert not leftovers(tmp_path)


@pytest.mark.timeout(120)
def test_a_live_but_late_peer_fails_the_waiting_rank_after_the_timeout(tmp_path) -> None:
    one, two = data(1000, 13), data(1000, 14)
    files = {0: {"s/two": two}, 1: {"s/one": one}}
    transfers = [move(1, 0, "s/one", one), move(0, 1, "s/two", two)]
    results = run(tmp_path, 2, files, transfers, timeout_s=2, stall=(1, 6))
    early = results[0]
    assert 1.5 < early["seconds"] < 5  # its 2 s timeout, not the 6 s its peer slept
    assert [f.kind for f in early["error"].failures] == ["communication", "communication"]
    # the first of its two directions to wait 2 s: "Timed out", the other: the pair closed
    assert "Timed out" in str(early["error"])
    # the late rank fails too (the waiting rank gave up and left), typed, not hung
    assert [f.kind for f in results[1]["error"].failures] == ["communication", "communication"]


@pytest.mark.timeout(120)
def test_a_receiver_that_cannot_write_takes_the_rest_of_the_file_and_both_sides_fail_it(
    tmp_path,
) -> None:
    blocked, ok = data(5000, 15), data(2500, 16)
    files = {0: {"s/blocked": blocked, "s/ok": ok}, 1: {"s/blocked/in-the-way": b"x"}}
    transfers = [move(0, 1, "s/blocked", blocked), move(0, 1, "s/ok", ok)]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000, timeout_s=30)
    for r in results:
        assert [(f.transfer.path, f.kind) for f in r["error"].failures] == [("s/blocked", "write")]
        assert "rank 1:" in str(r["error"]) and "could not be written" in str(r["error"])
    assert all(r["seconds"] < 10 for r in results), "nobody waited for the 30 s timeout"
    assert on_node(tmp_path, 1, "s/ok").read_bytes() == ok  # the exchange stayed in step
    assert on_node(tmp_path, 1, "s/blocked").is_dir()


@pytest.mark.timeout(120)
def test_transfers_on_a_background_thread_and_dedicated_group_beside_training_collectives(
    tmp_path,
) -> None:
    a, b = data(20_000, 17), data(9000, 18)
    files = {0: {"s/a": a}, 1: {"s/b": b}}
    transfers = [move(0, 1, "s/a", a), move(1, 0, "s/b", b)]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=512, in_thread=True)
    assert [(r["error"], r["training"]) for r in results] == [(None, 40.0), (None, 40.0)]
    assert on_node(tmp_path, 1, "s/a").read_bytes() == a
    assert on_node(tmp_path, 0, "s/b").read_bytes() == b


@pytest.mark.timeout(120)
@pytest.mark.parametrize("side", ["sender read", "receiver write"])
def test_a_disk_error_in_mid_stream_fails_that_file_on_both_sides_and_the_next_arrives_whole(
    tmp_path, side
) -> None:
    # each side works a chunk ahead (the sender reads the next chunk while one is sent, the
    # receiver receives the next while one is written): a failure after 4 of 10 chunks must
    # leave neither a half-sent chunk nor a reused buffer in the next file's bytes
    broken, after = data(10_000, 19), data(7000, 20)
    files = {0: {"s/broken": broken, "s/after": after}}
    transfers = [move(0, 1, "s/broken", broken), move(0, 1, "s/after", after)]
    failing_rank = 0 if side == "sender read" else 1
    results = run(
        tmp_path,
        2,
        files,
        transfers,
        chunk_bytes=1000,
        timeout_s=30,
        fail_after_chunks=(failing_rank, "s/broken", 4),
    )
    kind = "source" if side == "sender read" else "write"
    for r in results:
        assert [(f.transfer.path, f.kind) for f in r["error"].failures] == [("s/broken", kind)]
        assert f"rank {failing_rank}:" in str(r["error"])
    assert all(r["seconds"] < 10 for r in results), "nobody waited for the 30 s timeout"
    assert on_node(tmp_path, 1, "s/after").read_bytes() == after
    assert not on_node(tmp_path, 1, "s/broken").exists()
    assert results[0]["stats"].files_sent == 1
    assert not leftovers(tmp_path)
