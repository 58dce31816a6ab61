"""picasso_ops.data.prefetch.Prefetcher: order, read-ahead bound, errors, stopping, consumed-position state."""
from __future__ import annotations

import gc
import threading
import time
import traceback
import weakref
from pathlib import Path

import pytest

from picasso_ops.data import prefetch as prefetch_mod
from picasso_ops.data.prefetch import Prefetcher, PrefetchTimeout


def _wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class Counting:
    """An infinite source that counts what was read from it and whether it was closed."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.produced, self.closed, self.delay_s = 0, False, delay_s
        self.thread_names: set[str] = set()

    def __iter__(self):
        try:
            while True:
                if self.delay_s:
                    time.sleep(self.delay_s)
                self.thread_names.add(threading.current_thread().name)
                self.produced += 1
                yield self.produced - 1
        finally:
            self.closed = True

    def state(self) -> dict:
        return {"next": self.produced}


def test_order_is_preserved_and_the_end_is_reached():
    import random

    rng = random.Random(0)

    def jittery():
        for i in range(200):
            if rng.random() < 0.1:
                time.sleep(0.002)
            yield i

    with Prefetcher(jittery(), depth=3, poll_s=0.01) as p:
        got = []
        for x in p:
            if rng.random() < 0.1:
                time.sleep(0.002)  # the consumer is sometimes the slow side, sometimes the producer
            got.append(x)
        assert got == list(range(200)) and p.consumed == 200
        with pytest.raises(StopIteration):
            next(p)  # stays at the end
        assert not p._thread.is_alive()  # the thread ended with the source, before close


def test_reads_at_most_depth_ahead_and_on_another_thread():
    src = Counting()
    with Prefetcher(src, depth=3, state=src.state, poll_s=0.01, name="ahead") as p:
        assert _wait_until(lambda: src.produced == 3)
        time.sleep(0.2)  # a stalled consumer: the producer must not read more
        assert src.produced == 3 and p.buffered == 3 and p.consumed == 0
        assert next(p) == 0
        assert _wait_until(lambda: src.produced == 4)
        time.sleep(0.1)
        assert src.produced == 4 and p.consumed == 1
    assert src.thread_names == {"ahead"}


def test_state_is_the_consumed_position_not_the_produced_one():
    src = Counting()
    with Prefetcher(src, depth=4, state=src.state, poll_s=0.01) as p:
        assert p.state() == {"next": 0}  # before any batch: the starting point
        for k in range(1, 6):
            next(p)
            assert p.consumed == k and p.state() == {"next": k}
        assert _wait_until(lambda: src.produced == 9)
        assert src.state() == {"next": 9} and p.state() == {"next": 5}  # the source itself is 4 ahead
        snap = p.state()
        snap["next"] = -1  # a copy: callers cannot change the recorded position
        assert p.state() == {"next": 5}
    assert p.state() == {"next": 5}  # still readable after close (train_rec's last checkpoint)


def _file(tmp_path: Path, kind: str, rows: list[list[str]]) -> Path:
    from tests.picasso_ops.data.test_files import to_parquet, write_tsv

    if kind == "criteo":
        return write_tsv(tmp_path / "d.tsv", rows)
    return to_parquet(rows, tmp_path / "d.parquet", int_as_str=True, row_group_size=16)


def _reader(kind: str, path: Path, **kw):
    from picasso_ops.data import CriteoTSVReader, ParquetCTRReader

    cls = CriteoTSVReader if kind == "criteo" else ParquetCTRReader
    return cls([str(path)], 16, vocab_sizes=50, **kw)


@pytest.mark.parametrize("kind", ["criteo", "parquet"])
def test_file_reader_state_matches_reading_it_directly(tmp_path, kind):
    """Real readers with bad rows: the state after each consumed batch and at the end equals the direct one."""
    from tests.picasso_ops.data.test_files import random_rows

    rows = random_rows(300, seed=3)
    for k in range(36, 300, 37):
        rows[k][0] = "3"  # a bad label: counted and skipped
    path = _file(tmp_path, kind, rows)
    direct = _reader(kind, path, rank=1, world_size=2, max_bad_fraction=0.2)
    expected = [direct.state()]
    direct_batches = []
    for b in direct:
        direct_batches.append(b)
        expected.append(direct.state())
    src = _reader(kind, path, rank=1, world_size=2, max_bad_fraction=0.2)
    with Prefetcher(src, depth=2, state=src.state, poll_s=0.01) as p:
        got = [p.state()]
        for k, b in enumerate(p):
            assert b.labels.tolist() == direct_batches[k].labels.tolist()
            assert b.values.tolist() == direct_batches[k].values.tolist()
            assert b.dense.tolist() == direct_batches[k].dense.tolist()
            got.append(p.state())
    assert len(got) == len(direct_batches) + 1 > 5
    # the last entry is the state once the source ended (the end of the data), as after a direct read
    assert got == expected and got[-1]["bad_rows"] > 0


@pytest.mark.parametrize("kind", ["criteo", "parquet"])
def test_a_reader_data_error_keeps_its_type(tmp_path, kind):
    """Too many bad rows: the reader's DataError (naming the file) reaches the training loop as a DataError."""
    from picasso_ops.data import DataError
    from tests.picasso_ops.data.test_files import random_rows

    rows = random_rows(120, seed=4)
    for k in range(60, 120, 3):
        rows[k][0] = "7"
    path = _file(tmp_path, kind, rows)
    src = _reader(kind, path, max_bad_fraction=0.05)
    with Prefetcher(src, depth=2, state=src.state, poll_s=0.01) as p:
        assert next(p).batch_size == 16
        with pytest.raises(DataError, match=path.name):
            for _ in p:
                pass


def test_source_error_reaches_the_consumer_with_type_traceback_and_note():
    class DiskGone(OSError):
        pass

    def reading_the_disk():
        yield "a"
        yield "b"
        raise DiskGone("disk gone at row 1234")

    p = Prefetcher(reading_the_disk(), depth=4, poll_s=0.01, name="loader")
    assert next(p) == "a" and next(p) == "b"
    with pytest.raises(DiskGone, match="disk gone at row 1234") as info:
        next(p)
    err = info.value
    assert any("prefetch thread 'loader'" in n and "item 2" in n for n in getattr(err, "__notes__", []))
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert "reading_the_disk" in frames and "_produce" in frames  # the producer's frames are kept
    assert "loader" in "".join(traceback.format_exception(err))  # the note is printed with it
    assert not p._thread.is_alive()
    with pytest.raises(StopIteration):
        next(p)  # like a generator that raised: it is over
    p.close()


def test_state_callable_error_propagates_too():
    calls = {"n": 0}

    def state():
        calls["n"] += 1
        if calls["n"] > 2:  # construction, item 0, then item 1 fails
            raise KeyError("no resume point")
        return calls["n"]

    with Prefetcher(iter(range(10)), depth=2, state=state, poll_s=0.01) as p:
        assert next(p) == 0
        with pytest.raises(KeyError, match="no resume point"):
            next(p)


def test_close_stops_the_thread_and_closes_the_source():
    src = Counting(delay_s=0.005)
    p = Prefetcher(src, depth=2, poll_s=0.01)
    assert [next(p), next(p)] == [0, 1]
    p.close(timeout_s=5)
    assert not p._thread.is_alive()
    assert src.closed  # the generator's finally ran (open files would be closed)
    produced = src.produced
    time.sleep(0.05)
    assert src.produced == produced and p.buffered == 0
    with pytest.raises(RuntimeError, match="closed"):
        next(p)
    p.close()  # idempotent


def test_early_break_and_garbage_collection_stop_the_thread():
    src = Counting()
    p = Prefetcher(src, depth=2, poll_s=0.01)
    for i, _ in enumerate(p):
        if i == 2:
            break
    thread, ref = p._thread, weakref.ref(p)
    assert thread.is_alive()
    del p
    gc.collect()
    assert ref() is None  # the thread holds no reference to the prefetcher
    assert _wait_until(lambda: not thread.is_alive())
    assert src.closed


def test_stuck_source_hits_the_consumer_deadline_and_close_returns():
    release = threading.Event()

    def stuck():
        yield 0
        release.wait(timeout=10)
        yield 1

    p = Prefetcher(stuck(), depth=1, timeout_s=0.3, poll_s=0.02)
    assert next(p) == 0
    t0 = time.monotonic()
    with pytest.raises(PrefetchTimeout, match="no item within 0.3 s"):
        next(p)
    assert time.monotonic() - t0 < 3
    release.set()
    p.close(timeout_s=5)
    assert not p._thread.is_alive()


def test_a_producer_that_dies_without_a_message_does_not_hang_the_consumer(monkeypatch):
    monkeypatch.setattr(prefetch_mod, "_produce", lambda *args: None)  # ends at once, reporting nothing
    p = Prefetcher(iter(range(3)), depth=2, poll_s=0.01, name="dead")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="prefetch thread 'dead' ended without an item"):
        next(p)
    assert time.monotonic() - t0 < 3
    p.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Prefetcher(iter([]), depth=0)
    with pytest.raises(ValueError, match="poll_s > 0"):
        Prefetcher(iter([]), poll_s=0)


def test_config_field_is_validated_and_named():
    from picasso_ops.config import PicassoConfig
    from sparse_scale.config import ConfigError, parse_config

    assert PicassoConfig().interleave.prefetch_batches == 0  # off unless asked for
    assert PicassoConfig.model_validate({"interleave": {"prefetch_batches": 2}}).interleave.prefetch_batches == 2
    with pytest.raises(ConfigError, match=r"picasso\.interleave\.prefetch_batches: .*greater than or equal to 0"):
        parse_config({"picasso": {"interleave": {"prefetch_batches": -1}}}, source="x.json")
    with pytest.raises(ConfigError, match=r"picasso\.interleave\.prefetch_batches: .*less than or equal to 64"):
        parse_config({"picasso": {"interleave": {"prefetch_batches": 1000}}}, source="x.json")
    with pytest.raises(ConfigError, match=r"picasso\.interleave\.prefetch_batchs"):
        parse_config({"picasso": {"interleave": {"prefetch_batchs": 2}}}, source="x.json")
