"""The pipelined node-to-node transfers (core/tiers/transfer.py): each
side works one chunk ahead with two buffers used in turn (the sender reads the next chunk
while the last is in flight with isend, the receiver receives the next chunk on a thread
while it writes the last). Buffer reuse, failures in mid-stream on either side, storage
retries, interrupts, stalls and timeouts, threads and memory left behind. gloo on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_elastic.core.tiers import TransferIntegrityError
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.test_tier_transfer import data, leftovers, move, on_node
from tests.tiers import transfer_pipeline_workers as workers


def run(root: Path, world: int, files: dict, transfers: list, **kwargs) -> list[dict]:
    may_die = kwargs.pop("may_die", ())
    return run_distributed(
        workers.hostile_worker,
        world,
        str(root),
        files,
        transfers,
        timeout=60,
        may_die=may_die,
        **kwargs,
    )


def failures(result: dict) -> list[tuple[str, str]]:
    err = result["error"]
    return [] if err is None else [(f.transfer.path, f.kind) for f in err.failures]


def assert_clean(results: list[dict]) -> None:
    """No transfer thread and no chunk buffers outlive a call that ended normally."""
    for r in results:
        assert r["threads"] == [], r["threads"]
        assert r["buffer_sets"] == 0, "chunk buffers still referenced after the call"


# ----------------------------------------------------------------------------- buffer reuse


@pytest.mark.timeout(60)
def test_no_buffer_is_refilled_while_in_flight_or_while_the_writer_holds_it(tmp_path) -> None:
    """A slow writer (each chunk held 20 ms and checked) makes every isend of the sender
    wait for the receiver while the sender already fills the next buffer; the receiving
    thread is a chunk ahead of the writer. Files, memory with read-only pieces only (each
    through the two buffers, in turn), and a mix; in both directions between the pair."""
    a, b, c = data(9 * 512 + 17, 1), data(8 * 512, 2), data(5000, 3)
    ro = [bytes(c[:1500]), bytes(c[1500:1501]), bytes(c[1501:3000]), bytes(c[3000:])]
    mixed = [bytes(b[:700]), bytearray(b[700:2100]), bytes(b[2100:2200]), bytearray(b[2200:])]
    files = {0: {"s/a": a}, 1: {"s/a-back": a}}
    memory = {0: {"s/ro": ro}, 1: {"s/mixed": mixed}}
    transfers = [
        move(0, 1, "s/a", a),
        move(0, 1, "s/ro", c),
        move(1, 0, "s/mixed", b),
        move(1, 0, "s/a-back", a),
    ]
    hooks = [
        (r, name, kw)
        for r in (0, 1)
        for name, kw in (("slow_checked_writer", {"delay": 0.02}), ("checked_isends", {}))
    ]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=512, hooks=hooks, memory=memory)
    assert [failures(r) for r in results] == [[], []]
    assert on_node(tmp_path, 1, "s/a").read_bytes() == a
    assert on_node(tmp_path, 1, "s/ro").read_bytes() == c
    assert on_node(tmp_path, 0, "s/mixed").read_bytes() == b
    assert on_node(tmp_path, 0, "s/a-back").read_bytes() == a
    for r in results:
        assert r["seen"]["changed_while_held"] == 0
        assert r["seen"]["changed_in_flight"] == 0
        assert r["seen"]["isends_checked"] > 20
        assert r["seen"]["chunks_written"] >= 10
    assert_clean(results)


@pytest.mark.timeout(60)
def test_chunks_of_a_mebibyte_are_hashed_on_the_storage_thread_while_the_next_arrives(
    tmp_path,
) -> None:
    """Chunks >= 1 MiB are hashed on storage's hash thread while they are written: the
    receiving thread must not refill that buffer until the hash is done."""
    big = data(3 * 2**20 + 12345, 4)
    hooks = [(1, "slow_checked_writer", {"delay": 0.05}), (0, "checked_isends", {})]
    results = run(
        tmp_path, 2, {0: {"s/big": big}}, [move(0, 1, "s/big", big)], chunk_bytes=2**20, hooks=hooks
    )
    assert [failures(r) for r in results] == [[], []]
    assert on_node(tmp_path, 1, "s/big").read_bytes() == big
    assert results[1]["seen"]["changed_while_held"] == 0
    assert results[0]["seen"]["changed_in_flight"] == 0
    assert_clean(results)


# ----------------------------------------------------------------------------- sizes, many


@pytest.mark.timeout(60)
def test_many_transfers_of_edge_sizes_both_ways_leave_no_thread_and_no_buffers(
    tmp_path,
) -> None:
    """Sizes 0, 1, chunk-1, chunk, chunk+1, 2*chunk, 3*chunk from files and from memory, 28
    transfers alternating direction in one call; every receive starts a thread."""
    chunk = 256
    sizes = [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk]
    files: dict[int, dict[str, bytes]] = {0: {}, 1: {}}
    memory: dict[int, dict[str, list]] = {0: {}, 1: {}}
    transfers, expect = [], {}
    for i, n in enumerate(sizes):
        for src in (0, 1):
            content = data(n, 10 * i + src)
            f, m = f"s/file-{n}-from{src}", f"s/mem-{n}-from{src}"
            files[src][f] = content
            # memory: a read-only head and a writable tail (or the reverse), not chunk-aligned
            cut = n // 3
            pieces = [bytes(content[:cut]), bytearray(content[cut:])]
            memory[src][m] = pieces if i % 2 else [bytearray(content[:cut]), bytes(content[cut:])]
            transfers += [move(src, 1 - src, f, content), move(src, 1 - src, m, content)]
            expect[(1 - src, f)] = expect[(1 - src, m)] = content
    results = run(tmp_path, 2, files, transfers, chunk_bytes=chunk, memory=memory)
    assert [failures(r) for r in results] == [[], []]
    for (rank, path), content in expect.items():
        assert on_node(tmp_path, rank, path).read_bytes() == content, path
    assert results[0]["stats"].files_received == results[1]["stats"].files_received == 14
    assert_clean(results)
    assert not leftovers(tmp_path)


@pytest.mark.timeout(60)
def test_ranks_with_different_chunk_sizes_still_exchange_whole_files(tmp_path) -> None:
    """chunk_bytes is a per-rank setting: a receiver with smaller buffers than the sender's
    chunks grows one buffer (not both at once) and the pair still agrees."""
    a, b = data(7000, 5), data(6500, 6)
    files = {0: {"s/a": a}, 1: {"s/b": b}}
    transfers = [move(0, 1, "s/a", a), move(1, 0, "s/b", b), move(0, 1, "s/a2", a)]
    files[0]["s/a2"] = a
    hooks = [(1, "slow_checked_writer", {"delay": 0.01}), (0, "checked_isends", {})]
    results = run(tmp_path, 2, files, transfers, chunk_bytes={0: 3000, 1: 500}, hooks=hooks)
    assert [failures(r) for r in results] == [[], []]
    assert on_node(tmp_path, 1, "s/a").read_bytes() == a
    assert on_node(tmp_path, 0, "s/b").read_bytes() == b
    assert on_node(tmp_path, 1, "s/a2").read_bytes() == a
    assert results[1]["seen"]["changed_while_held"] == 0
    assert results[0]["seen"]["changed_in_flight"] == 0
    assert_clean(results)


# ----------------------------------------------------------------------------- the writer


@pytest.mark.timeout(60)
def test_a_transient_write_error_in_mid_stream_fails_the_file_once_not_a_restart(
    tmp_path,
) -> None:
    """EIO is transient: the storage layer retries the write, calling the chunk factory a
    second time. A received stream cannot restart: the file fails (write) on both sides at
    once, the rest of it is taken, and the next file arrives whole."""
    broken, after = data(6000, 7), data(3000, 8)
    files = {0: {"s/broken": broken, "s/after": after}}
    transfers = [move(0, 1, "s/broken", broken), move(0, 1, "s/after", after)]
    hooks = [(1, "eio_on_write", {"call": 3})]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000, timeout_s=20, hooks=hooks)
    assert [failures(r) for r in results] == [[("s/broken", "write")]] * 2
    assert all(r["seconds"] < 10 for r in results), "nobody waited for the 20 s timeout"
    assert on_node(tmp_path, 1, "s/after").read_bytes() == after
    assert not on_node(tmp_path, 1, "s/broken").exists()
    assert not leftovers(tmp_path)
    assert_clean(results)


@pytest.mark.timeout(60)
def test_a_transient_error_before_the_first_chunk_is_retried_and_the_file_arrives(
    tmp_path,
) -> None:
    """EIO when the receiver opens its temporary file: no chunk was taken yet, so the
    storage layer's retry may ask for the chunks again, and the transfer succeeds."""
    content = data(5000, 9)
    hooks = [(1, "eio_on_first_open", {})]
    results = run(
        tmp_path,
        2,
        {0: {"s/x": content}},
        [move(0, 1, "s/x", content)],
        chunk_bytes=1000,
        hooks=hooks,
    )
    assert [failures(r) for r in results] == [[], []]
    assert on_node(tmp_path, 1, "s/x").read_bytes() == content
    assert_clean(results)


@pytest.mark.timeout(60)
def test_an_exclusive_write_meeting_an_existing_file_fails_in_band_and_keeps_the_file(
    tmp_path,
) -> None:
    """write_stream raises CheckpointExistsError before taking any chunk (the receiver did
    not see the file when it checked): the stream is still taken, both sides fail the
    file as a write failure, the existing file is left alone, the next one arrives."""
    content, other, after = data(4000, 10), data(4000, 11), data(2000, 12)
    files = {0: {"s/x": content, "s/after": after}, 1: {"s/x": other}}
    transfers = [move(0, 1, "s/x", content), move(0, 1, "s/after", after)]
    hooks = [(1, "exists_lies", {"path": "s/x"})]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=700, timeout_s=20, hooks=hooks)
    assert [failures(r) for r in results] == [[("s/x", "write")]] * 2
    assert "exists" in str(results[1]["error"])
    assert all(r["seconds"] < 10 for r in results)
    assert on_node(tmp_path, 1, "s/x").read_bytes() == other
    assert on_node(tmp_path, 1, "s/after").read_bytes() == after
    assert_clean(results)


@pytest.mark.timeout(60)
def test_an_interrupt_in_mid_write_propagates_and_ends_the_receiving_thread(tmp_path) -> None:
    """A BaseException (KeyboardInterrupt-like) in the writer leaves the exchange: it
    reaches the caller, the receiving thread ends (not blocked on its semaphore for ever),
    no temporary file is left, and the sender fails by its timeout, typed."""
    content = data(10_000, 13)
    hooks = [(1, "abort_writer", {"path": "s/x", "after": 2})]
    results = run(
        tmp_path,
        2,
        {0: {"s/x": content}},
        [move(0, 1, "s/x", content)],
        chunk_bytes=1000,
        timeout_s=2,
        hooks=hooks,
        settle_s=1.0,
    )
    receiver, sender = results[1], results[0]
    assert receiver["other"] is not None and receiver["other"].startswith("Abort")
    assert receiver["threads"] == [], "the receiving thread outlived the interrupt"
    assert failures(sender) == [("s/x", "communication")]
    assert sender["seconds"] < 8
    assert not on_node(tmp_path, 1, "s/x").exists()
    assert not leftovers(tmp_path)


@pytest.mark.timeout(60)
def test_a_read_error_at_the_sender_and_a_write_error_at_the_receiver_in_one_file(
    tmp_path,
) -> None:
    """Both sides fail the same file (the receiver first, after 2 chunks; the sender after
    4): the receiver, draining, meets the sender's failure; both agree on one failure and
    the next file arrives whole."""
    broken, after = data(8000, 14), data(3000, 15)
    files = {0: {"s/broken": broken, "s/after": after}}
    transfers = [move(0, 1, "s/broken", broken), move(0, 1, "s/after", after)]
    hooks = [
        (0, "fail_reads_after", {"path": "s/broken", "n": 4}),
        (1, "fail_writes_after", {"path": "s/broken", "n": 2}),
    ]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000, timeout_s=20, hooks=hooks)
    assert [failures(r) for r in results] == [[("s/broken", "source")]] * 2
    assert all(r["seconds"] < 10 for r in results)
    assert on_node(tmp_path, 1, "s/after").read_bytes() == after
    assert not on_node(tmp_path, 1, "s/broken").exists()
    assert not leftovers(tmp_path)
    assert_clean(results)


# ----------------------------------------------------------------------------- the source


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["truncate", "replace"])
def test_a_source_file_changed_under_the_sender_in_mid_stream_is_not_kept(tmp_path, mode) -> None:
    """The sender's file is truncated (a read comes up short) or replaced by other bytes of
    the same size (the checksum fails after the last chunk was already sent) after 3 of 8
    chunks: no copy is kept at the receiver, both sides fail it, the next file arrives."""
    content, after = data(8000, 16), data(2500, 17)
    files = {0: {"s/x": content, "s/after": after}}
    transfers = [move(0, 1, "s/x", content), move(0, 1, "s/after", after)]
    hooks = [(0, "change_source_mid_stream", {"path": "s/x", "after": 3, "mode": mode})]
    results = run(tmp_path, 2, files, transfers, chunk_bytes=1000, timeout_s=20, hooks=hooks)
    kind = "source" if mode == "truncate" else "integrity"
    assert [failures(r) for r in results] == [[("s/x", kind)]] * 2
    if mode == "replace":
        assert all(isinstance(r["error"], TransferIntegrityError) for r in results)
    assert all(r["seconds"] < 10 for r in results)
    assert not on_node(tmp_path, 1, "s/x").exists()
    assert on_node(tmp_path, 1, "s/after").read_bytes() == after
    assert not leftovers(tmp_path)
    assert_clean(results)


@pytest.mark.timeout(60)
def test_a_memory_source_that_raises_fails_in_band_not_by_the_receivers_timeout(
    tmp_path,
) -> None:
    """``sources[path]()`` itself raising (the staged payload is gone) is a failure of the
    sender's source like a missing file: reported in the header's place at once, the
    later transfers with that peer still happen, and the sender raises a TransferError."""
    after = data(2000, 18)
    files = {0: {"s/after": after}}
    memory = {0: {"s/staged": "raise"}}
    transfers = [move(0, 1, "s/staged", data(3000, 19)), move(0, 1, "s/after", after)]
    results = run(tmp_path, 2, files, transfers, timeout_s=8, memory=memory)
    assert results[0]["other"] is None, results[0]["other"]
    assert [failures(r) for r in results] == [[("s/staged", "source")]] * 2
    assert all(r["seconds"] < 4 for r in results), "the receiver waited for its timeout"
    assert on_node(tmp_path, 1, "s/after").read_bytes() == after


@pytest.mark.timeout(60)
def test_a_write_that_cannot_restart_reports_the_error_that_stopped_it(tmp_path) -> None:
    """The failure both sides report for a transient write error in mid-stream names that
    error (what an operator needs), not only that the stream could not restart."""
    broken = data(6000, 23)
    hooks = [(1, "eio_on_write", {"call": 3})]
    results = run(
        tmp_path,
        2,
        {0: {"s/broken": broken}},
        [move(0, 1, "s/broken", broken)],
        chunk_bytes=1000,
        timeout_s=20,
        hooks=hooks,
    )
    for r in results:
        assert failures(r) == [("s/broken", "write")]
        assert "Input/output error" in r["error"].failures[0].reason


# ----------------------------------------------------------------------------- stalls


@pytest.mark.timeout(60)
def test_a_peer_stalling_in_mid_chunk_fails_every_later_transfer_of_the_waiting_rank_at_once(
    tmp_path,
) -> None:
    """Rank 1 stalls between a chunk's header and its bytes longer than rank 0's timeout. A
    gloo ``wait(timeout)`` that expires closes every connection of the group on that rank
    (probed: a send to a third rank then fails with "pair closure"), so rank 0 fails all its
    later transfers at once, typed, rather than each by its own timeout (the module header);
    rank 2 sees the connection close. Nobody crashes, no thread or half-written copy is left,
    and late bytes of rank 1 land nowhere."""
    stalled, other, later = data(6000, 20), data(40_000, 21), data(1000, 22)
    files = {1: {"s/stalled": stalled, "s/later": later}, 2: {"s/other": other}}
    transfers = [
        move(1, 0, "s/stalled", stalled),
        move(2, 0, "s/other", other),
        move(1, 0, "s/later", later),
    ]
    hooks = [
        (1, "stall_chunk_send", {"nth": 3, "seconds": 2.5}),
        (2, "slow_reads", {"path": "s/other", "delay": 0.05}),  # 40 chunks over ~2 s
    ]
    results = run(
        tmp_path,
        3,
        files,
        transfers,
        chunk_bytes=1000,
        timeout_s=1.0,
        hooks=hooks,
        settle_s=1.0,
    )
    receiver, late, third = results
    assert receiver["other"] is None and late["other"] is None, (receiver, late)
    assert receiver["threads"] == []
    assert not on_node(tmp_path, 0, "s/stalled").exists()
    assert not on_node(tmp_path, 0, "s/other").exists()
    assert not leftovers(tmp_path)
    assert [k for _, k in failures(late)] == ["communication", "communication"]
    assert failures(receiver) == [
        ("s/stalled", "communication"),
        ("s/other", "communication"),
        ("s/later", "communication"),
    ]
    assert "timed out earlier" in str(receiver["error"])
    assert failures(third) == [("s/other", "communication")]
