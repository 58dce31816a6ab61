"""BatchClaims: batch numbers in lockstep (sync) and first come first served (gba), on a real TCPStore."""
import datetime

import pytest
from torch.distributed import TCPStore

from gba_engine.claims import BatchClaims


@pytest.fixture()
def store():
    return TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))  # port 0: a free one


def test_sync_phase_is_lockstep_with_drop_last(store):
    claims = [BatchClaims(store, 3, w, total=10) for w in range(3)]
    for c in claims:
        c.enter_sync(base=1)
    got = [[c.next() for _ in range(4)] for c in claims]
    assert got == [[1, 4, 7, None], [2, 5, 8, None], [3, 6, 9, None]]  # 10 - 1 = 9 batches: three whole steps
    assert claims[0].taken == 10 and claims[0].next_free == 8  # capped at total


def test_gba_phase_shares_one_counter_and_resumes_from_taken(store):
    a, b = BatchClaims(store, 2, 0, total=7), BatchClaims(store, 2, 1, total=7)
    a.enter_gba(phase=1, base=2)
    b.enter_gba(phase=1, base=2)
    order = [a.next(), a.next(), b.next(), a.next(), b.next(), a.next()]
    assert order == [2, 3, 4, 5, 6, None]  # fast worker a took four of the five
    assert a.taken == b.taken == 7 and a.next_free == 6 and b.next_free == 7  # the failed claim is not a batch
    # the next phase starts where every worker's numbers end (the engine all-reduces next_free)
    a.enter_sync(base=max(a.next_free, b.next_free))
    assert a.next() is None  # 7 of 7 taken


def test_bad_arguments(store):
    with pytest.raises(ValueError, match="worker_index 2"):
        BatchClaims(store, 2, 2, total=4)
    with pytest.raises(ValueError, match="total batches"):
        BatchClaims(store, 2, 0, total=-1)
