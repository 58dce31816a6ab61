"""--epochs N over training files: the seeded plan (by hand), the epoch readers, exact resume, per-epoch eval.

Unit tests need no process group; the end-to-end ones (marked slow) run train_rec in a spawned
process: two epochs straight against a run stopped mid-epoch 1 and resumed, on one rank (plain
DeepSpeed) and on one worker plus one parameter server (a gba block in sync mode).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from picasso_ops.data import CriteoTSVReader, ParquetCTRReader, Prefetcher
from picasso_ops.data.epoch_stream import EPOCH_END, EpochFileStream, EpochPosition, EpochRowRanges
from picasso_ops.data.epochs import EpochPlan, SplitMix64, permutation, seed_of
from sparse_scale.multiproc import run_distributed
from sparse_scale.rec.checkpoint import Progress
from sparse_scale.rec.data import ClaimedBatches, RankStream
from tests.picasso_ops.data.test_files import random_rows, row_ids, to_parquet, write_tsv

ROOT = Path(__file__).resolve().parents[3]
B, W = 4, 3  # rows per batch, batches per shuffle window
SIZES = (13, 9, 17)  # rows of the three training files


# ---------------------------------------------------------------- the plan, against hand computation

def test_splitmix64_gives_the_reference_outputs():
    rng = SplitMix64(1234567)  # the reference implementation's published test vector
    assert [rng.next() for _ in range(5)] == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                              4593380528125082431, 16408922859458223821]
    assert SplitMix64(0).next() == 0xE220A8397B1DCDAF
    assert seed_of(7) == SplitMix64(7).next()
    assert seed_of(3, 5) == SplitMix64(SplitMix64(3).next() ^ 5).next()
    assert seed_of(-1) == SplitMix64((1 << 64) - 1).next()  # negative seeds count modulo 2^64


def test_fisher_yates_by_hand():
    # outputs of SplitMix64(1234567): 6457827717110365317 % 4 = 1, 3203168211198807973 % 3 = 1,
    # 9817491932198370423 % 2 = 1. [0,1,2,3]: swap 3<->1 -> [0,3,2,1]; swap 2<->1 -> [0,2,3,1]; 1<->1 stays.
    assert (6457827717110365317 % 4, 3203168211198807973 % 3, 9817491932198370423 % 2) == (1, 1, 1)
    assert permutation(4, 1234567) == [0, 2, 3, 1]
    # SplitMix64(0): 16294208416658607535 % 3 = 1 -> [0,2,1]; 7960286522194355700 % 2 = 0 -> swap 1<->0: [2,0,1]
    assert permutation(3, 0) == [2, 0, 1]
    assert permutation(1, 99) == [0] and permutation(0, 99) == []


def test_epoch_zero_keeps_file_order_later_epochs_draw_from_seed_and_epoch():
    plan = EpochPlan(seed=1234, window=4)
    assert plan.file_order(0, 5) == [0, 1, 2, 3, 4] and plan.window_order(0, 7, 4) == [0, 1, 2, 3]
    assert not plan.shuffled(0) and plan.shuffled(1)
    assert plan.file_order(1, 5) == permutation(5, seed_of(1234, 1, 1))  # (seed, epoch, file stream)
    assert plan.window_order(2, 3, 4) == permutation(4, seed_of(1234, 2, 2, 3))  # (seed, epoch, window stream, w)
    orders = [tuple(plan.file_order(e, 5)) for e in range(1, 9)]
    assert all(sorted(o) == list(range(5)) for o in orders) and len(set(orders)) > 1
    assert plan.file_order(3, 5) == EpochPlan(seed=1234, window=4).file_order(3, 5)  # every rank computes the same
    assert EpochPlan(seed=1235, window=4).file_order(1, 5) != plan.file_order(1, 5) or \
        EpochPlan(seed=1235, window=4).window_order(1, 0, 4) != plan.window_order(1, 0, 4)
    assert EpochPlan(seed=1234, shuffle_first=True).file_order(0, 5) == permutation(5, seed_of(1234, 0, 1))


def test_read_index_and_numbered_batches_by_hand():
    plan = EpochPlan(seed=1234, window=4)
    # epochs of 10 batches: windows [0..3], [4..7], [8, 9]
    w0, w1, w2 = plan.window_order(1, 0, 4), plan.window_order(1, 1, 4), plan.window_order(1, 2, 2)
    assert [plan.read_index(1, i, 10) for i in range(10)] == [*w0, *(4 + p for p in w1), *(8 + p for p in w2)]
    assert plan.numbered(13, per_epoch=10) == (1, w0[3])  # epoch 1, its 4th emitted batch
    assert plan.numbered(27, per_epoch=10) == (2, 4 + plan.window_order(2, 1, 4)[3])
    assert plan.numbered(29, per_epoch=10) == (2, 8 + plan.window_order(2, 2, 2)[1])
    assert plan.numbered(7, per_epoch=10) == (0, 7)  # epoch 0: the files' order
    for epoch in (1, 2, 5):  # a bijection that never leaves its window: bounded memory, no long seeks
        got = [plan.read_index(epoch, i, 10) for i in range(10)]
        assert sorted(got) == list(range(10)) and all(r // 4 == i // 4 for i, r in enumerate(got))
    with pytest.raises(IndexError, match="outside the epoch's 10 batches"):
        plan.read_index(1, 10, 10)
    with pytest.raises(ValueError, match="window must be >= 1"):
        EpochPlan(seed=1, window=0)
    with pytest.raises(ValueError, match="a window holds 1..4 batches"):
        plan.window_order(1, 0, 5)


# ---------------------------------------------------------------- the readers

@pytest.fixture
def files(tmp_path):
    """Three TSV files of 13, 9 and 17 rows (ids 0..38; I1 holds the id); row 20 (2nd file) is bad."""
    paths, first = [], 0
    for k, n in enumerate(SIZES):
        rows = random_rows(n, seed=10 + k, first_id=first)
        if k == 1:
            rows[20 - first][0] = "7"  # label 7: a bad row, skipped
        paths.append(write_tsv(tmp_path / f"part{k}.tsv", rows))
        first += n
    return paths


def _ids_of_files():
    ids, first = [], 0
    for n in SIZES:
        ids.append([None if i == 20 else i for i in range(first, first + n)])
        first += n
    return ids


def _expected(plan, epochs, rank=0, world=1):
    """Each epoch's batches of row ids, computed from the plan alone: shard, batch, permute each window."""
    out = []
    for epoch in range(epochs):
        rows = [i for f in plan.file_order(epoch, len(SIZES)) for i in _ids_of_files()[f]]
        mine = [i for g, i in enumerate(rows) if g % world == rank and i is not None]
        batches = [mine[k:k + B] for k in range(0, len(mine), B)]
        for first in range(0, len(batches), plan.window):
            window = batches[first:first + plan.window]
            out += [window[p] for p in plan.window_order(epoch, first // plan.window, len(window))]
        out.append("END")
    return out[:-1]


def _tsv_stream(paths, plan, epochs, start=EpochPosition(), rank=0, world=1):
    def open_reader(order, row):
        return CriteoTSVReader([paths[i] for i in order], B, rank=rank, world_size=world, start_row=row,
                               max_bad_fraction=0.5, chunk_bytes=500)
    return EpochFileStream(open_reader, len(paths), plan, epochs, start=start)


def _ids(items):
    return ["END" if item is EPOCH_END else row_ids([item]) for item in items]


def test_epoch_file_stream_reads_each_epoch_in_its_plan_and_marks_the_ends(files):
    plan = EpochPlan(seed=7, window=W)
    got = _ids(_tsv_stream(files, plan, epochs=3))
    assert got == _expected(plan, 3) and got.count("END") == 2
    every = [i for i in range(sum(SIZES)) if i != 20]
    epochs = " ".join(" ".join(map(str, b)) if b != "END" else "|" for b in got).split("|")
    assert [sorted(int(v) for v in e.split()) for e in epochs] == [every] * 3  # every good row once per epoch
    assert got[:4] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # epoch 0: files as given
    assert got != _expected(EpochPlan(seed=8, window=W), 3)  # another --seed shuffles otherwise


def test_two_ranks_share_the_plan_and_split_every_epoch(files):
    plan = EpochPlan(seed=7, window=W)
    shards = [_ids(_tsv_stream(files, plan, 2, rank=r, world=2)) for r in (0, 1)]
    for rank in (0, 1):
        assert shards[rank] == _expected(plan, 2, rank=rank, world=2)
    split = [[i for b in s[s.index("END") + 1:] for i in b] for s in shards]  # epoch 1 of each rank
    assert sorted(split[0] + split[1]) == [i for i in range(sum(SIZES)) if i != 20]


def test_resume_from_every_position_continues_exactly(files):
    plan = EpochPlan(seed=3, window=W)
    straight_stream = _tsv_stream(files, plan, epochs=3)
    straight, states = [], []
    for item in straight_stream:
        straight.append(item)
        states.append(straight_stream.state())
    ids = _ids(straight)
    assert straight_stream.state() == {"epoch": 3, "next_row": 0, "window": 0, "taken": 0}  # every epoch read
    more = _ids(_tsv_stream(files, plan, 4, start=EpochPosition.from_state(straight_stream.state())))
    four = _expected(plan, 4)
    assert more == four[len(ids) + 1:] and four[:len(ids)] == ids  # a finished run given --epochs 4 reads epoch 3
    for k, state in enumerate(states):  # stop after item k (a checkpoint), resume in a fresh reader
        resumed = _ids(_tsv_stream(files, plan, 3, start=EpochPosition.from_state(state)))
        assert resumed == ids[k + 1:], (k, state)
    shuffled = [s for s in states if s["epoch"] == 1 and s["taken"] not in (0, W)]
    assert shuffled and all(s["window"] >= 0 and s["next_row"] >= 0 for s in shuffled)  # mid-window positions
    # a one-epoch reader's old state ({"next_row": r, ...}) resumes as epoch 0 at row r
    assert EpochPosition.from_state({"next_row": 8, "rows_yielded": 8}) == EpochPosition(0, 8, 0, 0)


def test_prefetched_epoch_stream_records_the_consumed_position(files):
    plan = EpochPlan(seed=3, window=W)
    plain = _tsv_stream(files, plan, 2)
    want = []
    for _ in plain:
        want.append(plain.state())
    source = _tsv_stream(files, plan, 2)
    with Prefetcher(source, depth=3, state=source.state) as ahead:
        for k, item in enumerate(ahead):
            assert ahead.state() == want[k]


def test_parquet_files_take_the_same_plan(files, tmp_path):
    plan, first, paths = EpochPlan(seed=5, window=2), 0, []
    for k, n in enumerate(SIZES):
        paths.append(to_parquet(random_rows(n, seed=20 + k, first_id=first), tmp_path / f"p{k}.parquet",
                                row_group_size=5))
        first += n
    stream = EpochFileStream(lambda order, row: ParquetCTRReader([paths[i] for i in order], B, start_row=row),
                             len(paths), plan, 2)
    got = _ids(stream)
    epoch1 = [i for b in got[got.index("END") + 1:] for i in b]
    first_file = plan.file_order(1, 3)[0]
    assert sorted(epoch1) == list(range(sum(SIZES)))
    assert sorted(epoch1[:4]) != list(range(4)) or first_file == 0  # epoch 1 starts in its own first file
    assert set(got[got.index("END") + 1]) | set(got[got.index("END") + 2]) == \
        set(range(sum(SIZES[:first_file]), sum(SIZES[:first_file]) + 8))  # its first window: its first 8 rows


def _ranges(paths, plan, gas):
    return EpochRowRanges(lambda order, row: CriteoTSVReader([paths[i] for i in order], B, start_row=row,
                                                             max_bad_fraction=0.5), len(paths), plan, B, gas)


def test_numbered_batches_over_epochs_hold_their_rows(files):
    plan = EpochPlan(seed=11, window=W)
    ranges = _ranges(files, plan, gas=2)
    assert ranges.num_rows == 39 and ranges.per_epoch == 39 // 8
    for number in (0, 2, 4, 5, 8, 9, 11, 14):  # one worker's increasing numbers, with gaps (others took the rest)
        epoch, read = plan.numbered(number, ranges.per_epoch)
        rows = [i for f in plan.file_order(epoch, 3) for i in _ids_of_files()[f]]
        for j in (0, 1):
            want = [i for i in rows[(read * 2 + j) * B:(read * 2 + j + 1) * B] if i is not None]
            assert row_ids([ranges.micro(number, j)]) == want, (number, j)
        assert ranges.epoch_of(number) == epoch
    with pytest.raises(ValueError, match="read forward only"):
        ranges.micro(1, 0)


# ---------------------------------------------------------------- the training streams

def test_rank_stream_moves_every_rank_to_the_next_epoch_together(files):
    plan = EpochPlan(seed=7, window=W)
    stream = RankStream(_tsv_stream(files, plan, 3), micro_batch=B, finite=True, epochs=3)
    batches, got, ends = iter(stream), [], []
    while True:
        batch = next(batches, None)
        if stream.step_samples(batch, group=None) == 0:
            ends += stream.epoch_ends(None)
            if not stream.next_epoch():
                break
            ends += stream.epoch_ends(None)
            got.append("END")
            continue
        got.append(row_ids([batch]))
    assert got == _expected(plan, 3) and ends == [0, 1] and stream.finished_epochs() == 3
    assert stream.state() == {"epoch": 3, "next_row": 0, "window": 0, "taken": 0}
    # another rank's shard ended first: this rank drops the rest of its epoch and goes on with the next one
    early = RankStream(_tsv_stream(files, plan, 2), micro_batch=B, finite=True, epochs=2)
    first = next(iter(early))
    assert early.next_epoch() and early.epoch == 1 and early.epoch_ends(None) == [0]
    want = _expected(plan, 2)
    assert row_ids([first]) == [0, 1, 2, 3] and row_ids([next(early)]) == want[want.index("END") + 1]
    assert not early.next_epoch() and early.finished_epochs() == 2  # the last epoch: the job's end


class _Claims:
    """A stand-in for a sync GBA engine: hands out ``numbers``; batches_taken as the sync claims count them."""

    mode, version = "sync", 1

    def __init__(self, numbers):
        self.numbers, self.batches_taken = list(numbers), 0

    def claim_batches(self, total, start=0):
        for n in self.numbers:
            if n >= total:
                return
            self.batches_taken = n + 1
            yield n


def test_claimed_batches_over_epochs_report_their_ends_in_lockstep(files):
    plan = EpochPlan(seed=11, window=W)
    ranges = _ranges(files, plan, gas=1)
    per = ranges.per_epoch  # 9 whole batches of 4 rows per epoch
    engine = _Claims(range(3 * per))
    stream = ClaimedBatches(engine, ranges, B, gas=1, total=3 * per, workers=1, epochs=3, lockstep_epochs=True)
    ends, items = [], iter(stream)
    for number in range(3 * per):
        mark = stream.mark()
        batch = next(items)
        want_epoch, read = plan.numbered(number, per)
        rows = [i for f in plan.file_order(want_epoch, 3) for i in _ids_of_files()[f]]
        assert row_ids([batch]) == [i for i in rows[read * B:(read + 1) * B] if i is not None]
        ends += [(number, e) for e in stream.epoch_ends(mark)]
    assert ends == [(per - 1, 0), (2 * per - 1, 1)]  # the last epoch's end is the job's end evaluation
    assert next(items, None) is None and stream.finished_epochs() == 3
    assert stream.state() == {"batches_taken": 3 * per, "epoch": 3} and stream.tag(Progress()) == f"batch{3 * per}"
    resumed = ClaimedBatches(_Claims(range(per + 2, 3 * per)), _ranges(files, plan, gas=1), B, gas=1, total=3 * per, workers=1,
                             start=per + 2, epochs=3)  # gba mode: no per-epoch evaluation
    next(iter(resumed))
    assert resumed.epoch_ends((per, "gba")) == [] and not resumed.next_epoch()


class _LoopEngine:
    """Just enough engine for train_loop on one rank: a linear model on the dense features, a log of what it saw."""

    worker_group, gathers_live, samples_seen, mode = None, False, 0, "deepspeed"

    def __init__(self):
        self.module = torch.nn.Linear(13, 1)
        self.log: list = []  # row ids of each training micro-batch, "EVAL" for each evaluation
        self.events: list = []

    def __call__(self, dense, values, lengths):
        if self.module.training:
            self.log.append([round(float(v)) for v in torch.expm1(dense[:, 0].double())])  # I1 = log1p(row id)
        return self.module(dense).squeeze(-1)

    def backward(self, loss):
        loss.backward()

    def step(self):
        return None

    def write_events(self, events):
        self.events += list(events)

    def eval(self):
        self.log.append("EVAL")
        self.module.eval()

    def train(self):
        self.module.train()


@pytest.mark.parametrize("gas", [1, 3])
def test_train_loop_evaluates_each_epoch_end_and_loses_no_batch(files, tmp_path, gas):
    from sparse_scale.rec import RecJobConfig
    from sparse_scale.rec.data import rank_stream
    from sparse_scale.rec.faults import FaultInjector
    from sparse_scale.rec.job import RecJob
    from sparse_scale.rec.loop import train_loop

    cfg = json.loads(Path(_ds_config(tmp_path)).read_text())
    cfg.update(train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=gas)
    (tmp_path / "gas.json").write_text(json.dumps(cfg))
    job = RecJob.build(RecJobConfig(config=str(tmp_path / "gas.json"), data="criteo", epochs=2, steps=100,
                                    train_files=tuple(map(str, files)), eval_files=(str(files[0]),),
                                    max_bad_fraction=0.5, vocab=64), 0, 1)
    engine = _LoopEngine()
    result = train_loop(job, engine, rank_stream(job, Progress(), None), Progress(), FaultInjector(0, [], None),
                        tmp_path / "ckpt")
    want = [b for b in _expected(EpochPlan(seed=1234), 2) if b != "END"]  # 10 micro-batches per epoch, one window
    trained = [b for b in engine.log if b != "EVAL"]
    assert trained == want  # nothing dropped at the epoch's end, nothing repeated
    assert result.exhausted and result.finished_epochs == 2
    assert [h["epoch"] for h in result.eval_history] == [0]  # the last epoch: the runner's end evaluation
    assert ("eval/epoch", 0.0) in [(n, v) for n, v, _ in engine.events]
    steps = result.progress.step
    assert result.progress.samples == sum(len(b) for b in trained[:steps * gas])  # whole steps count
    if gas == 1:  # at a step boundary: scored after step 10, before the first batch of epoch 1
        assert steps == 20 and engine.log.index("EVAL") == 10 and result.eval_history[0]["step"] == 10
    else:  # step 4 holds epoch 0's last micro-batch and epoch 1's first two; scored after it
        assert steps == 6 and engine.log.index("EVAL") == 12 and result.eval_history[0]["step"] == 4


# ---------------------------------------------------------------- flags and the --steps contradiction

def _ds_config(tmp_path, gba=False, micro=8):
    cfg = json.loads((ROOT / "ds_configs" / ("gba_cpu.json" if gba else "demo_cpu.json")).read_text())
    cfg.update(train_micro_batch_size_per_gpu=micro, wandb={"enabled": False})
    if gba:
        cfg["gba"].update(mode="sync", timeout_s=20, heartbeat_s=0.5)
    else:  # a fixed schedule length: "auto" would follow --steps, which differs between the halves of a resume
        cfg["scheduler"]["params"].update(total_num_steps=40, warmup_num_steps=2)
    path = tmp_path / ("gba.json" if gba else "ds.json")
    path.write_text(json.dumps(cfg))
    return str(path)


def test_epochs_flag_and_its_checks(files, tmp_path):
    from sparse_scale.rec import RecJobConfig, RecJobError
    from sparse_scale.rec.cli import job_config, parse_args
    from sparse_scale.rec.data import check_epochs
    from sparse_scale.rec.job import RecJob

    cfg = _ds_config(tmp_path)
    data = dict(data="criteo", train_files=tuple(map(str, files)), eval_files=(str(files[0]),))
    flags = ["--config", cfg, "--data", "criteo", "--train-files", *map(str, files), "--eval-files", str(files[0])]
    assert job_config(parse_args([*flags, "--epochs", "3"])).epochs == 3
    assert job_config(parse_args(["--config", cfg])).epochs == 1
    with pytest.raises(RecJobError, match=r"--epochs 2: needs file data"):
        RecJobConfig(config=cfg, epochs=2)
    with pytest.raises(RecJobError, match=r"--epochs 0: must be an integer >= 1"):
        RecJobConfig(config=cfg, epochs=0, **data)
    # 39 lines over 2 ranks: at most 20 rows, 3 micro-batches of 8 per rank and epoch, so 3 epochs take <= 9 steps
    check_epochs(RecJob.build(RecJobConfig(config=cfg, epochs=3, steps=7, **data), 0, 2))  # reaches epoch 2
    with pytest.raises(RecJobError, match=r"--epochs 3 with --steps 6: .* at most 9 steps .* pass --steps 9"):
        check_epochs(RecJob.build(RecJobConfig(config=cfg, epochs=3, steps=6, **data), 1, 2))
    # a gba job: 39 rows hold 4 numbered batches of 8, 2 workers take 2 a step: 3 epochs are 6 steps
    gba = _ds_config(tmp_path, gba=True)
    check_epochs(RecJob.build(RecJobConfig(config=gba, epochs=3, steps=5, **data), 0, 3))
    with pytest.raises(RecJobError, match=r"at most 6 steps"):
        check_epochs(RecJob.build(RecJobConfig(config=gba, epochs=3, steps=4, **data), 0, 3))


# ---------------------------------------------------------------- end to end

def _recorded_run(rank: int, world_size: int, cfg: str, base: dict, window: int) -> dict:
    """One train_rec run of ``RecJobConfig(config=cfg, **base)`` in this process: the row ids of every batch it
    trained, its final parameters, its summary and its ``eval/*`` events (a server rank: ``{"server": True}``)."""
    from picasso_ops.data.epochs import EpochPlan
    from sparse_scale.rec import RecJobConfig, data, engines, model, run

    data.epoch_plan = lambda job: EpochPlan(seed=job.config.seed, window=window)  # small windows: resume inside one
    trained: list[list[int]] = []
    events: list[tuple[str, float]] = []

    class Recorder(torch.nn.Module):
        """The job's model, noting the row ids (I1 = log1p(id)) of every training batch it sees."""

        def __init__(self, job):
            super().__init__()
            self.inner = model.build_model(job)

        def forward(self, dense, values, lengths):
            if self.training:
                trained.append([round(float(v)) for v in torch.expm1(dense[:, 0].double())])
            return self.inner(dense, values, lengths)

    for cls in (engines.DeepSpeedRecEngine, engines.GBARecEngine):
        original = cls.write_events
        cls.write_events = lambda self, ev, _o=original: (events.extend((n, v) for n, v, _ in ev), _o(self, ev))[1]
    nets: list[torch.nn.Module] = []
    summary = run(RecJobConfig(config=cfg, **base), wandb_mode="disabled",
                  model_factory=lambda job: nets.append(Recorder(job)) or nets[-1])
    if summary.is_server:
        return {"server": True}
    return {"trained": trained, "params": {k: v.detach().clone() for k, v in nets[-1].state_dict().items()},
            "summary": summary.to_dict(), "events": [e for e in events if e[0].startswith("eval/")]}


def _straight_half_resumed(cfg: str, base: dict, stop: int, out: Path, world_size: int) -> dict:
    """Run A (straight), then run B stopped after ``stop`` steps and resumed; each a launch of its own."""
    got = {}
    for name, changes in (("straight", {"out": str(out / "a")}), ("half", {"out": str(out / "b"), "steps": stop}),
                          ("resumed", {"out": str(out / "b"), "resume": True})):
        got[name] = run_distributed(_recorded_run, world_size, args=(cfg, {**base, **changes}, 2), timeout_s=55,
                                    init_process_group=False)
    return got


def _check_resumed_run_matches(got: dict, epochs: int) -> None:
    straight, half, resumed = got["straight"], got["half"], got["resumed"]
    assert half["trained"] + resumed["trained"] == straight["trained"]  # the same batches in the same order
    for name, value in straight["params"].items():
        assert torch.allclose(resumed["params"][name], value, rtol=0, atol=1e-6), name
    assert resumed["summary"]["log_loss"] == pytest.approx(straight["summary"]["log_loss"], abs=1e-6)
    history = straight["summary"]["eval_history"]
    assert [h["epoch"] for h in history] == list(range(epochs))  # one evaluation per epoch, the last at the end
    assert history[-1]["auc"] == straight["summary"]["auc"]
    epochs_seen = [v for n, v in straight["events"] if n == "eval/epoch"]
    assert epochs_seen == [float(e) for e in range(epochs)]
    assert resumed["summary"]["eval_history"][-1]["epoch"] == epochs - 1


@pytest.mark.slow
def test_two_epochs_straight_equal_a_run_stopped_mid_epoch_and_resumed(files, tmp_path):
    evalf = write_tsv(tmp_path / "eval.tsv", random_rows(24, seed=30, first_id=100))
    base = dict(data="criteo", train_files=tuple(map(str, files)), eval_files=(str(evalf),), epochs=2, steps=40,
                vocab=64, threads=1, max_bad_fraction=0.5)
    runs = _straight_half_resumed(_ds_config(tmp_path), base, 8, tmp_path / "runs", world_size=1)
    got = {name: ranks[0] for name, ranks in runs.items()}
    straight = got["straight"]
    # 38 good rows in batches of 8: 4 whole and one of 6 per epoch; 2 epochs = 10 steps
    assert straight["summary"]["steps"] == 10 and straight["summary"]["samples"] == 2 * 38
    flat = [i for b in straight["trained"] for i in b]
    every = [i for i in range(sum(SIZES)) if i != 20]
    assert sorted(flat[:38]) == every and sorted(flat[38:]) == every and flat[:38] != flat[38:]
    # stopped after 3 batches of epoch 1: inside its 2nd shuffled window of 2, as the checkpoint records
    assert got["half"]["summary"]["steps"] == 8
    saved = torch.load(tmp_path / "runs" / "b" / "checkpoints" / "step8" / "mp_rank_00_model_states.pt",
                       weights_only=False)
    assert [{k: s[k] for k in ("epoch", "window", "taken")} for s in saved["data_states"]] == \
        [{"epoch": 1, "window": 1, "taken": 1}]
    _check_resumed_run_matches(got, epochs=2)


@pytest.mark.slow
@pytest.mark.soak
def test_gba_sync_job_over_two_epochs_resumes_exactly(files, tmp_path):
    evalf = write_tsv(tmp_path / "eval.tsv", random_rows(24, seed=31, first_id=100))
    base = dict(data="criteo", train_files=tuple(map(str, files)), eval_files=(str(evalf),), epochs=2, steps=40,
                vocab=64, threads=1, max_bad_fraction=0.5)
    runs = _straight_half_resumed(_ds_config(tmp_path, gba=True), base, 7, tmp_path / "runs", world_size=2)
    assert all(ranks[1] == {"server": True} for ranks in runs.values())  # rank 1 serves, rank 0 trains
    got = {name: ranks[0] for name, ranks in runs.items()}
    # 39 rows hold 4 numbered batches of 8 per epoch: 8 steps for the one worker; stopped inside epoch 1's 2nd window
    assert got["straight"]["summary"]["steps"] == 8 and got["half"]["summary"]["steps"] == 7
    assert Path(got["half"]["summary"]["checkpoint"]).name == "batch7"
    _check_resumed_run_matches(got, epochs=2)
