"""The two directions of the node-to-node transfers (core/tiers/transfer.py):
a rank sends its transfers (calling thread) while it receives its own (thread
``le-transfer-in``), each direction in list order, on one gloo group, each transfer's
messages tagged with its index. Interrupts in one direction while the other is busy,
threads outliving the call, cycles and many transfers between one pair. gloo on CPU. Last,
in one process with hand-made lanes: how a call raises when both directions crash
(``transfer._raise_crash``)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_elastic import Storage
from lightning_elastic.core.tiers import transfer
from lightning_elastic.core.tiers.transfer import execute_transfers
from lightning_elastic.errors import ConfigError
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.test_tier_transfer import data, leftovers, move, on_node
from tests.tiers import transfer_lanes_workers as lane_workers


def run(root: Path, world: int, files: dict, transfers: list, **kwargs) -> list[dict]:
    """The transfers on ``world`` ranks (chunks of 1000 bytes and a 5 s timeout unless
    given): each rank's result."""
    kwargs = {"chunk_bytes": 1000, "timeout_s": 5, **kwargs}
    return run_distributed(
        lane_workers.lanes_worker, world, str(root), files, transfers, timeout=60, **kwargs
    )


def slow(rank: int, paths: list[str], delay: float) -> list[tuple[int, str, dict]]:
    """Storage hooks: ``rank`` takes ``delay`` seconds more to read each chunk of ``paths``."""
    return [(rank, "slow_reads", {"path": p, "delay": delay}) for p in paths]


# ----------------------------------------------------------------------------- interrupts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["sending", "receiving"])
def test_an_interrupt_in_one_direction_starts_no_more_transfers_in_the_other(
    tmp_path, where
) -> None:
    """A BaseException (KeyboardInterrupt-like) in one direction of rank 0 (its memory
    source, or its writer) reaches the caller; the other direction, busy with a slow
    transfer, finishes that one but starts no later one: the caller was interrupted, as
    it was when one thread did both directions (it would otherwise copy on for as long as
    the other direction has work, and only then raise)."""
    later = [f"s/later{i}" for i in range(4)]
    contents = {p: data(1000, 40 + i) for i, p in enumerate(later)}
    x = data(3000, 39)
    if where == "sending":  # rank 0 sends s/x from memory (interrupted) and receives later*
        files = {0: {}, 1: contents}
        transfers = [move(0, 1, "s/x", x)] + [move(1, 0, p, contents[p]) for p in later]
        kwargs = {
            "memory": {0: {"s/x": "raise"}},
            "lane_hooks": [(0, "abort_memory_source", {})],
            "hooks": slow(1, later, 0.4),
        }
    else:  # rank 0 receives s/x (its write interrupted) and sends later*
        files = {0: contents, 1: {"s/x": x}}
        transfers = [move(1, 0, "s/x", x)] + [move(0, 1, p, contents[p]) for p in later]
        kwargs = {"hooks": [(0, "abort_writer", {"path": "s/x", "after": 0}), *slow(0, later, 0.4)]}
    results = run(tmp_path, 2, files, transfers, settle_s=2.0, **kwargs)
    interrupted = results[0]
    assert interrupted["other"] is not None and interrupted["other"].startswith("Abort")
    got = 0 if where == "sending" else 1
    arrived = [p for p in later if on_node(tmp_path, got, p).exists()]
    assert arrived[:1] == later[:1] or arrived == [], arrived
    assert len(arrived) <= 1, f"copied on after the interrupt: {arrived}"
    assert interrupted["lanes"]["threads_at_return"] == []
    assert interrupted["threads"] == []
    assert not leftovers(tmp_path)


@pytest.mark.timeout(60)
def test_both_directions_crashing_raise_one_and_name_the_other(tmp_path) -> None:
    """Rank 0's writer (receiving) is interrupted, then its memory source (sending, 1 s
    into the read, so the receive has begun before either stops the other): the sending
    direction's interrupt is raised, with a note naming the receiving one's, which used to be
    dropped without a trace."""
    x, y = data(3000, 51), data(3000, 52)
    files = {0: {}, 1: {"s/y": y}}
    transfers = [move(0, 1, "s/x", x), move(1, 0, "s/y", y)]
    results = run(
        tmp_path,
        2,
        files,
        transfers,
        memory={0: {"s/x": "raise"}},
        lane_hooks=[(0, "abort_memory_source", {"delay": 1.0})],
        hooks=[(0, "abort_writer", {"path": "s/y", "after": 0})],
    )
    crashed = results[0]
    assert crashed["other"] == "Abort: interrupted while reading the staged payload"
    assert len(crashed["notes"]) == 1, crashed["notes"]
    assert crashed["notes"][0].startswith("the receiving direction crashed too: Abort(")
    assert "interrupted after 0 chunks" in crashed["notes"][0]
    assert crashed["lanes"]["threads_at_return"] == []
    assert not leftovers(tmp_path)


def interrupted_while_receiving(
    tmp_path: Path,
    count: int,
    read_delay: float,
    interrupt_s: float,
    hooks: list[tuple[int, str, dict]] | None = None,
    lane_hooks: list[tuple[int, str, dict]] | None = None,
) -> tuple[dict, list[str], bytes]:
    """Rank 0 sends one small file, then its calling thread waits for its receiving thread
    (``count`` files from rank 1, which reads each chunk ``read_delay`` s late) when Ctrl-C
    reaches it ``interrupt_s`` s into the call. Rank 0's result (a KeyboardInterrupt), the
    paths it receives, and the bytes it sent."""
    later = [f"s/later{i}" for i in range(count)]
    contents = {p: data(1000, 50 + i) for i, p in enumerate(later)}
    first = data(10, 49)
    files = {0: {"s/first": first}, 1: contents}
    transfers = [move(0, 1, "s/first", first)] + [move(1, 0, p, contents[p]) for p in later]
    results = run(
        tmp_path,
        2,
        files,
        transfers,
        settle_s=2.5,
        hooks=[*slow(1, later, read_delay), *(hooks or [])],
        lane_hooks=[(0, "interrupt_after", {"delay": interrupt_s}), *(lane_hooks or [])],
    )
    interrupted = results[0]
    assert interrupted["other"] is not None
    assert interrupted["other"].startswith("KeyboardInterrupt"), interrupted["other"]
    return interrupted, later, first


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_for_the_receiving_direction_leaves_no_thread_behind(
    tmp_path,
) -> None:
    """Rank 0's sends are done and its calling thread waits for its receiving thread, which
    is busy with slow transfers, when Ctrl-C comes. The KeyboardInterrupt reaches the caller,
    and no thread of the call outlives it: a receiving thread left running would go on
    writing files into the node's tier after the call raised, and take messages with the
    same tags (list indices) as the next call on the same group."""
    interrupted, later, first = interrupted_while_receiving(
        tmp_path, 4, 0.4, 0.3, lane_hooks=[(0, "time_receives", {})]
    )
    seen = interrupted["lanes"]
    after = [p for p, at in seen["received_at"].items() if at > seen["returned_at"]]
    assert after == [], f"received after the call raised: {after}"
    assert interrupted["threads"] == []
    assert not on_node(tmp_path, 0, later[-1]).exists(), "written after the call raised"
    assert on_node(tmp_path, 1, "s/first").read_bytes() == first
    assert not leftovers(tmp_path)


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_receiving_direction_crashes_names_that_crash(tmp_path) -> None:
    """Ctrl-C reaches rank 0's calling thread while it waits for its receiving thread, whose
    write of the transfer in progress then fails with a BaseException: the KeyboardInterrupt
    is raised, with a note naming that crash (it was dropped without a trace)."""
    abort = (0, "abort_writer", {"path": "s/later0", "after": 0})
    interrupted, later, _ = interrupted_while_receiving(tmp_path, 2, 1.0, 0.4, hooks=[abort])
    assert len(interrupted["notes"]) == 1, interrupted["notes"]
    note = interrupted["notes"][0]
    assert note.startswith("the receiving direction crashed too: Abort("), note
    # the direction's thread has ended; the aborted file's own receiver may still wait for
    # the stream's last message (its sender reads slowly), then ends
    assert "le-transfer-in" not in interrupted["lanes"]["threads_at_return"]
    assert interrupted["threads"] == []
    assert not on_node(tmp_path, 0, later[1]).exists(), "received after the interrupt"
    assert not leftovers(tmp_path)


# ----------------------------------------------------------------------------- relays


def test_a_file_passed_on_in_the_same_call_is_refused_on_every_rank(tmp_path) -> None:
    """``0 -> 1`` then ``1 -> 2`` of one file (a relay): one thread per rank walking the list
    sent it on after it arrived; with both directions at once rank 1 starts sending it while
    it still receives it, so the relay fails as "missing" at the source, or not, by a race.
    Refused up front, like any invalid list, on every rank alike (nothing is sent)."""
    content = data(100, 60)
    relay = [move(0, 1, "s/p", content), move(1, 2, "s/p", content)]
    storage = Storage(str(tmp_path))
    for rank in (0, 1, 2):
        with pytest.raises(ConfigError, match="passed on"):
            execute_transfers(relay, rank=rank, group=None, storage=storage)
    # the other order (sent, then received back), and the same file between other ranks: fine
    for fine in (relay[::-1], [move(0, 1, "s/p", content), move(2, 3, "s/p", content)]):
        assert execute_transfers(fine, rank=4, group=None, storage=storage).files_sent == 0


# ----------------------------------------------------------------------------- layouts


@pytest.mark.timeout(60)
def test_four_ranks_in_cycles_both_ways_with_edge_sizes_and_chunk_sizes_all_arrive(
    tmp_path,
) -> None:
    """Replicas=2 among ranks 0-2 (each sends its shard to both others: cycles both ways),
    six small files between ranks 0 and 1 alternating direction, a rank that only sends
    (3), zero-byte files, shards from memory (writable and read-only pieces), one file the
    receiver holds already; chunk sizes 1, 7, 2**30 and 64 on the four ranks. Every file
    arrives whole, each rank's stats add up to its share of the list, and no thread or
    chunk buffer outlives the call."""
    files: dict[int, dict[str, bytes]] = {r: {} for r in range(4)}
    memory: dict[int, dict[str, list]] = {2: {}}
    transfers, expect = [], {}

    def add(src: int, dst: int, path: str, content: bytes) -> None:
        transfers.append(move(src, dst, path, content))
        expect[(dst, path)] = content

    for r in range(3):
        shard = data(40 + 13 * r, 70 + r)
        path = f"s/shard{r}"
        if r == 2:
            memory[2][path] = [bytes(shard[:11]), bytearray(shard[11:])]
        else:
            files[r][path] = shard
        for k in (1, 2):
            add(r, (r + k) % 3, path, shard)
    for i in range(6):
        src = i % 2
        content = data(0 if i == 2 else 9 + i, 80 + i)
        files[src][f"s/pair{i}"] = content
        add(src, 1 - src, f"s/pair{i}", content)
    only = data(25, 90)
    files[3].update({"s/only": only, "s/zero": b""})
    add(3, 0, "s/only", only)
    add(3, 1, "s/zero", b"")
    add(3, 2, "s/only", only)
    files[2]["s/only"] = only  # already held by the receiver: present on both sides
    del expect[(2, "s/only")]
    results = run(
        tmp_path,
        4,
        files,
        transfers,
        chunk_bytes={0: 1, 1: 7, 2: 2**30, 3: 64},
        memory=memory,
        timeout_s=20,
    )
    assert [r["other"] for r in results] == [None] * 4
    assert [r["error"] for r in results] == [None] * 4
    for (rank, path), content in expect.items():
        assert on_node(tmp_path, rank, path).read_bytes() == content, (rank, path)
    for rank, r in enumerate(results):
        sent = [t for t in transfers if t.src == rank and (t.dst, t.path) in expect]
        got = [t for t in transfers if t.dst == rank and (t.dst, t.path) in expect]
        present = [t for t in transfers if rank in (t.src, t.dst) and (t.dst, t.path) not in expect]
        s = r["stats"]
        assert (s.files_sent, s.bytes_sent) == (len(sent), sum(t.size for t in sent)), rank
        assert (s.files_received, s.bytes_received) == (len(got), sum(t.size for t in got))
        assert s.files_present == len(present), rank
        assert r["threads"] == [] and r["buffer_sets"] == 0, (rank, r["threads"])
    assert not leftovers(tmp_path)


# ----------------------------------------------------------------------------- timeouts


@pytest.mark.timeout(60)
def test_a_timeout_in_one_direction_fails_the_other_in_mid_stream_and_a_new_group_works(
    tmp_path,
) -> None:
    """Rank 0 receives from rank 1, which stalls past the timeout, while it sends a slow file
    to rank 2. The timeout closes every connection of the group on rank 0: its send in
    mid-stream fails too, at once and typed, and so does everything later in both
    directions; ranks 1 and 2 fail their transfers with rank 0 and return. Then each rank
    replaces the group, as the tier runtime does at the next save, and a second call with
    transfers both ways on the new group succeeds; no thread is left."""
    stalled, slow_file, later, back = data(6000, 100), data(20_000, 101), data(500, 102), b"z"
    files = {0: {"s/slow": slow_file}, 1: {"s/stalled": stalled, "s/later": later}}
    files[2] = {"s/back": back}
    first = [
        move(1, 0, "s/stalled", stalled),
        move(0, 2, "s/slow", slow_file),
        move(1, 0, "s/later", later),
        move(2, 0, "s/back", back),
    ]
    fresh = {f"s/new{i}": data(3000 + i, 110 + i) for i in range(4)}
    for i, src in enumerate((0, 1, 2, 0)):
        files[src][f"s/new{i}"] = fresh[f"s/new{i}"]
    pairs = [(0, 1), (1, 0), (2, 0), (0, 2)]
    second = [move(s, d, f"s/new{i}", fresh[f"s/new{i}"]) for i, (s, d) in enumerate(pairs)]
    results = run_distributed(
        lane_workers.rebuild_worker,
        3,
        str(tmp_path),
        files,
        first,
        second,
        timeout=50,
        chunk_bytes=1000,
        timeout_s=1.0,
        hooks=[
            (1, "stall_chunk_send", {"nth": 3, "seconds": 2.5}),
            (0, "slow_reads", {"path": "s/slow", "delay": 0.1}),  # 20 chunks over ~2 s
        ],
    )
    for rank, r in enumerate(results):
        assert r["first"]["other"] is None and r["second"]["other"] is None, (rank, r)
        assert r["second"]["error"] is None, (rank, r["second"]["error"])
        assert r["threads"] == [], (rank, r["threads"])
    mine = [(t.path, f.kind) for f in results[0]["first"]["error"].failures for t in [f.transfer]]
    assert mine == [(t.path, "communication") for t in first]
    assert "timed out earlier" in str(results[0]["first"]["error"])
    for rank in (1, 2):
        kinds = [f.kind for f in results[rank]["first"]["error"].failures]
        assert kinds and set(kinds) == {"communication"}, (rank, kinds)
    assert not on_node(tmp_path, 2, "s/slow").exists()
    for i, (_, dst) in enumerate(pairs):
        assert on_node(tmp_path, dst, f"s/new{i}").read_bytes() == fresh[f"s/new{i}"]
    assert results[0]["second"]["stats"].files_received == 2
    assert not leftovers(tmp_path)


# ---------------------------------------------------------- both directions crashing, one process


def lanes(sending: BaseException | None, receiving: BaseException | None) -> list[Any]:
    return [
        SimpleNamespace(crashed=sending, sending=True),
        SimpleNamespace(crashed=receiving, sending=False),
    ]


class NoNotes(Exception):
    """An exception whose ``__notes__`` is not a list: ``add_note`` raises TypeError."""

    @property
    def __notes__(self) -> tuple[str, ...]:  # type: ignore[override]
        return ()


class BadRepr(Exception):
    def __repr__(self) -> str:
        raise RuntimeError("repr failed")


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        (NoNotes("sending broke"), RuntimeError("receiving broke")),
        (RuntimeError("sending broke"), BadRepr("receiving broke")),
    ],
    ids=["add_note-fails", "repr-fails"],
)
def test_the_sending_crash_is_raised_even_when_naming_the_other_fails(
    sent: BaseException, received: BaseException, caplog
) -> None:
    """Naming the receiving direction's crash in a note of the sending one's failed (an
    exception that takes no notes, or whose repr raises): the note's TypeError/RuntimeError
    was raised instead, and the sending direction's crash was lost."""
    with caplog.at_level(logging.ERROR), pytest.raises(BaseException) as info:
        transfer._raise_crash(lanes(sent, received))
    assert info.value is sent
    assert any(r.exc_info and r.exc_info[1] is received for r in caplog.records)


def test_one_exception_in_both_directions_is_raised_once_without_a_note(caplog) -> None:
    crash = KeyboardInterrupt()
    with caplog.at_level(logging.ERROR), pytest.raises(KeyboardInterrupt) as info:
        transfer._raise_crash(lanes(crash, crash))
    assert info.value is crash
    assert not getattr(crash, "__notes__", [])
    assert not caplog.records


def test_an_interrupt_in_the_receiving_direction_is_named_and_logged(caplog) -> None:
    """A BaseException in the other direction is logged with its traceback and named."""
    sent, received = RuntimeError("sending broke"), KeyboardInterrupt("receiving")
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as info:
        transfer._raise_crash(lanes(sent, received))
    assert info.value is sent
    assert info.value.__notes__ == [
        "the receiving direction crashed too: KeyboardInterrupt('receiving')"
    ]
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [received]
