"""sparse_scale.rec's combination rules (each refusal names its reason) and its fault injector."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_scale.rec.combinations import RULES, CombinationError, check_combinations, refusals
from sparse_scale.rec.config import RecJobConfig, RecJobError
from sparse_scale.rec.faults import (CALIBRATION_STEPS, CRASH_EXIT_CODE, Crash, FaultInjector, Straggler,
                                     parse_crash, parse_straggler)

ROOT = Path(__file__).resolve().parents[3]


def _file(tmp_path: Path, name: str, **blocks) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    cfg.update(blocks)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture()
def files(tmp_path):
    gba = {"mode": "gba", "num_servers": 1}
    return {
        "plain": _file(tmp_path, "plain"),
        "gba": _file(tmp_path, "gba", gba=gba),
        "sync": _file(tmp_path, "sync", gba={**gba, "mode": "sync"}),
        "gba+picasso": _file(tmp_path, "both", gba=gba, picasso={"packing": True}),
        "gba+row-wise": _file(tmp_path, "rw", gba=gba, picasso={"sharding": "row_wise"}),
        "gba+interleave": _file(tmp_path, "il", gba=gba, picasso={"interleave": {"micro_batches": 2}}),
        "gba+prefetch": _file(tmp_path, "pf", gba=gba, picasso={"interleave": {"prefetch_batches": 2}}),
        "gba+memory-cache": _file(tmp_path, "mc", gba=gba, picasso={"cache": {"rows": 100, "store": "memory"}}),
        "gba+ps-cache": _file(tmp_path, "pc", gba=gba, picasso={"cache": {"rows": 100, "store": "ps"}}),
        "gba+moe": _file(tmp_path, "gm", gba=gba, moe_proto={"num_experts": 4, "ep_size": 2}),
        "gba+moe-ep1": _file(tmp_path, "gm1", gba=gba, moe_proto={"num_experts": 4, "ep_size": 1}),
        "gba+moe-bias": _file(tmp_path, "gmb", gba=gba, moe_proto={"num_experts": 4, "expert_bias_update_rate": 0.1}),
        "moe_model": _file(tmp_path, "mm", moe_model={"num_layers": 2, "d_model": 32, "num_heads": 2,
                                                       "ffn_hidden_size": 64}),
        "dropless": _file(tmp_path, "dl", moe_proto={"num_experts": 4, "dropless": True, "min_capacity": 8}),
        "picasso8": _file(tmp_path, "p8", picasso={"embedding_dim": 8}),
        "gba+warn": _file(tmp_path, "gw", gba=gba, picasso={"bounds_check": "warn"}),
    }


REFUSED = [
    ("gba+row-wise", "gba+picasso-row-wise", {}, "picasso.sharding 'row_wise' with a gba block: the packed tables'"),
    ("gba+interleave", "gba+picasso-interleave", {}, "picasso.interleave.micro_batches > 1 with a gba block"),
    ("gba+prefetch", "gba+picasso-prefetch", {}, "picasso.interleave.prefetch_batches > 0 with a gba block"),
    ("gba+memory-cache", "gba+picasso-cache", {}, "picasso.cache.store='memory' with a gba block: that store keeps"),
    ("plain", "ps-link-without-gba", {"ps_link_latency_ms": 0.5}, "--ps-link-latency-ms / --ps-link-mbit model the"),
    ("gba+moe", "gba+moe-expert-parallel", {}, "all-to-all, which needs the workers in lockstep"),
    ("moe_model", "moe-model-in-rec", {}, "a moe_model block shapes the MoE language model"),
    ("gba", "eval-every+async", {"eval_every": 5}, "--eval-every with gba.mode='gba': workers run at their own pace"),
    ("gba", "rejoin+resume", {"rejoin_as": 1, "resume": True}, "--rejoin-as continues the running job's state"),
    ("sync", "rejoin+sync", {"rejoin_as": 1}, "--rejoin-as needs gba.mode gba or auto: a sync job keeps DeepSpeed's"),
    ("plain", "rejoin-without-gba", {"rejoin_as": 1}, "--rejoin-as needs a gba block (a restarted worker joins"),
    ("plain", "server-tables-without-gba", {"server_tables": True}, "--server-tables needs a gba block (the tables"),
    ("plain", "files-without-files", {"data": "criteo", "train_files": ("a.tsv",)},
     "--data criteo needs --train-files and --eval-files"),
    ("gba+moe-bias", "gba+moe-global-load", {}, "sum expert loads over the workers every step, and gba workers run "
                                                "asynchronously"),
    ("dropless", "moe-dropless-unused-keys", {}, "moe_proto.dropless is true, so the layers keep every route and "
                                                 "never read moe_proto.min_capacity"),
    ("picasso8", "embedding-dim+picasso", {"embedding_dim": 32}, "--embedding-dim 32 with a picasso block: the "
                                                                 "packed tables take picasso.embedding_dim (8)"),
    ("gba+warn", "bounds-check-unsupported", {}, 'picasso.bounds_check "warn" with a gba block'),
]


def test_every_rule_is_exercised():
    assert sorted(r.name for r in RULES) == sorted(rule for _, rule, _, _ in REFUSED)


@pytest.mark.parametrize("file,rule,flags,reason", REFUSED, ids=[r[1] for r in REFUSED])
def test_each_refused_combination_names_its_reason(files, file, rule, flags, reason):
    job = RecJobConfig(config=files[file], **flags)
    found = refusals(job)
    assert [e.rule for e in found] == [rule]
    assert reason in str(found[0])
    if rule not in ("rejoin+resume", "files-without-files"):  # flag-only reasons; the others name the file
        assert str(found[0]).startswith(files[file] + ": ")
    with pytest.raises(CombinationError, match=f"^{str(found[0])[:30]}"):
        check_combinations(job)


@pytest.mark.parametrize("file,flags", [
    ("plain", {}), ("plain", {"eval_every": 5, "save_every": 2, "resume": True}),
    ("gba", {"server_tables": True, "save_every": 2}), ("gba", {"rejoin_as": 1}), ("sync", {"eval_every": 5}),
    ("plain", {"data": "parquet", "train_files": ("a",), "eval_files": ("b",)}),
    ("gba+picasso", {}), ("gba+ps-cache", {"ps_link_latency_ms": 0.5, "ps_link_mbit": 1000.0}), ("gba+moe-ep1", {}),
])
def test_allowed_combinations_pass(files, file, flags):
    job = RecJobConfig(config=files[file], **flags)
    assert refusals(job) == []
    check_combinations(job)


def test_several_refusals_are_all_listed_and_the_first_is_raised(files):
    job = RecJobConfig(config=files["plain"], rejoin_as=0, server_tables=True)
    assert [e.rule for e in refusals(job)] == ["rejoin-without-gba", "server-tables-without-gba"]
    with pytest.raises(CombinationError, match="--rejoin-as needs a gba block"):
        check_combinations(job)


# ----------------------------------------------------------------------------- faults


@pytest.mark.parametrize("text,expected", [("1:4", Straggler(1, 4.0)), ("0:1.5:20-60", Straggler(0, 1.5, 20, 60))])
def test_parse_straggler(text, expected):
    assert parse_straggler(text) == expected


@pytest.mark.parametrize("flags,match", [
    ({"steps": 0}, "--steps 0: must be >= 1"), ({"steps": -5}, "--steps -5: must be >= 1"),
    ({"fields": 0}, "--fields 0: must be >= 1"), ({"vocab": 0}, "--vocab 0: must be >= 1"),
    ({"embedding_dim": 0}, "--embedding-dim 0: must be >= 1"), ({"max_hot": 0}, "--max-hot 0: must be >= 1"),
    ({"num_dense": -1}, "--num-dense -1: must be >= 0"), ({"eval_samples": 0}, "--eval-samples 0: must be >= 1"),
    ({"zipf": float("nan")}, "--zipf nan: must be a finite exponent"),
    ({"max_bad_fraction": 1.5}, r"--max-bad-fraction 1.5: must be in \[0, 1\]"),
    ({"max_bad_fraction": float("nan")}, "--max-bad-fraction nan"),
    ({"save_every": -1}, "--save-every -1: must be >= 0"),
])
def test_flags_out_of_range_are_refused_before_training_and_name_the_flag(files, flags, match):
    with pytest.raises(RecJobError, match=match):
        RecJobConfig(config=files["plain"], **flags)
    RecJobConfig(config=files["plain"], steps=1, num_dense=0, zipf=0.0, max_bad_fraction=0.0)  # the edges are fine


@pytest.mark.parametrize("text,match", [("1", "expected RANK:FACTOR"), ("1:0.5", "FACTOR a finite number >= 1"),
                                        ("0:nan", "FACTOR a finite number >= 1"), ("0:inf", "finite"),
                                        ("-1:2", "RANK must be >= 0"), ("1:2:5-5", "empty step window 5-5"),
                                        ("1:x", "could not convert")])
def test_bad_straggler_text_says_why(text, match):
    with pytest.raises(ValueError, match=match):
        parse_straggler(text)


def test_parse_crash():
    assert parse_crash("1:3") == Crash(1, 3)
    with pytest.raises(ValueError, match=r"--crash '1:0': RANK must be >= 0 and STEP >= 1 \(expected RANK:STEP\)"):
        parse_crash("1:0")


class _Recorder:
    def __init__(self):
        self.sleeps, self.exits = [], []


def _injector(rank, stragglers, crash=None):
    rec = _Recorder()
    return FaultInjector(rank, stragglers, crash, sleep=rec.sleeps.append, exit=rec.exits.append), rec


def test_straggler_sleeps_factor_minus_one_times_the_calibrated_median_inside_its_window():
    faults, rec = _injector(1, [Straggler(1, 4.0, start=5, end=8), Straggler(0, 10.0)])
    for s in (0.3, 0.1, 0.2):  # the first micro-steps calibrate and are never delayed
        assert faults.before_backward(step=6) == 0.0
        faults.after_backward(s)
    assert faults.calibrated and CALIBRATION_STEPS == 3
    faults.after_backward(5.0)  # later steps do not move the calibration
    assert faults.before_backward(step=4) == 0.0 and faults.before_backward(step=8) == 0.0  # outside [5, 8)
    assert faults.before_backward(step=5) == pytest.approx(3 * 0.2)  # median 0.2, factor 4
    assert rec.sleeps == [pytest.approx(0.6)]  # only the delayed step slept; rank 0's straggler is not this rank's


def test_rank_without_stragglers_never_sleeps_or_exits():
    faults, rec = _injector(0, [Straggler(1, 4.0)], Crash(1, 2))
    for step in range(1, 6):
        faults.after_backward(0.1)
        faults.before_backward(step)
        faults.after_step(step)
    assert rec.sleeps == [] and rec.exits == [] and not faults.calibrated


def test_crash_exits_with_code_17_after_its_step_only():
    faults, rec = _injector(1, [], Crash(1, 3))
    for step in (1, 2):
        faults.after_step(step)
    assert rec.exits == []
    faults.after_step(3)
    assert rec.exits == [CRASH_EXIT_CODE] == [17]
