"""The two kinds of training stream behind sparse_scale.rec.data.TrainStream, without any process group."""
from __future__ import annotations

from picasso_ops.data.synthetic import SyntheticConfig, SyntheticCTRGenerator, SyntheticCTRStream
from sparse_scale.rec.checkpoint import Progress
from sparse_scale.rec.data import ClaimedBatches, RankStream


class _Claims:
    """A stand-in for a GBA engine's batch claims: hands out ``numbers``, then reports the job's count."""

    def __init__(self, numbers, mode="gba"):
        self.numbers, self.mode, self.version, self.batches_taken = list(numbers), mode, 3, 0

    def claim_batches(self, total, start=0):
        for n in self.numbers:
            self.batches_taken = n + 1
            yield n


CFG = SyntheticConfig(num_fields=26, vocab_sizes=20, num_dense=2, seed=0)


def test_claimed_batches_read_the_claimed_numbers_and_report_job_wide():
    engine = _Claims([0, 3, 4])
    stream = ClaimedBatches(engine, SyntheticCTRGenerator.for_config(CFG), micro_batch=8, gas=2, total=10, workers=2)
    assert stream.is_claimed
    got = list(stream)
    assert len(got) == 6 and all(b.batch_size == 8 for b in got)  # gas 2 micro-batches per claimed number
    direct = SyntheticCTRGenerator.for_config(CFG).batch(8, 3 * 2 + 1, "train")  # number 3, its 2nd micro-batch
    assert got[3].values.equal(direct.values)
    assert stream.state() == {"batches_taken": 5} and stream.tag(Progress(step=1)) == "batch5"
    assert stream.job_step(Progress(step=1)) == 4 // 2  # the last claimed number over the workers
    assert stream.resume_states(group=None) == [{"batches_taken": 5}]
    assert stream.step_samples(got[0], group=None) == 8 and stream.step_samples(None, group=None) == 0
    assert stream.monitor_x(Progress()) == 3 * 8 * 2 * 2  # the engine's updates x the job's global batch


def test_claimed_batches_save_when_a_period_of_job_batches_passes():
    engine = _Claims([])
    stream = ClaimedBatches(engine, SyntheticCTRGenerator.for_config(CFG), micro_batch=8, gas=1, total=10, workers=2)
    engine.batches_taken = 3
    mark = stream.mark()
    engine.batches_taken = 4  # period 2 x 2 workers = 4 batches: 3 -> 4 crosses it
    assert stream.save_due(2, Progress(step=1), mark)
    engine.batches_taken = 3
    assert not stream.save_due(2, Progress(step=1), stream.mark())
    engine.batches_taken, mark = 3, (3, "gba")
    engine.mode, engine.batches_taken = "sync", 8
    assert not stream.save_due(2, Progress(step=1), mark)  # just back from gba: the next period saves


def test_rank_stream_counts_steps_and_the_whole_job():
    source = SyntheticCTRStream(CFG, 8, rank=0, world_size=1, split="train")
    stream = RankStream(source, micro_batch=8, finite=False)
    assert not stream.is_claimed
    batch = next(iter(stream))
    assert stream.step_samples(batch, group=None) == 8  # synthetic: never ends, no collective
    p = Progress().after_step(micro_batches=1, samples=8)
    assert (p.step, p.micro_batches, p.samples) == (1, 1, 8)
    assert stream.tag(p) == "step1" and stream.job_step(p) == 1 and stream.monitor_x(p) == 8
    assert stream.save_due(1, p, stream.mark()) and not stream.save_due(2, p, stream.mark())
    assert stream.state() == source.state()
    finite = RankStream([batch], micro_batch=8, finite=True)
    assert finite.step_samples(batch, group=None) == 8 and finite.step_samples(None, group=None) == 0
