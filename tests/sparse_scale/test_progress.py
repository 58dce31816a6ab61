"""sparse_scale.progress: the one Progress record of the rec and MoE LM jobs, and the records they saved before."""
import dataclasses
import json

import pytest

from sparse_scale.progress import Progress


def test_both_jobs_records_are_one_class():
    from sparse_scale.lm import Progress as LMProgress
    from sparse_scale.lm.checkpoints import Progress as LMCheckpointProgress
    from sparse_scale.rec.checkpoint import Progress as RecProgress

    assert LMProgress is LMCheckpointProgress is RecProgress is Progress


def test_records_saved_before_the_merge_load():
    rec = Progress.from_dict({"step": 4, "micro_batches": 8, "samples": 2048}, "rec step4")
    lm = Progress.from_dict(json.loads('{"step": 3, "micro_batches": 3, "tokens": 3072}'), "lm step3")
    assert (rec.step, rec.micro_batches, rec.samples, rec.tokens) == (4, 8, 2048, 0)
    assert (lm.step, lm.micro_batches, lm.samples, lm.tokens) == (3, 3, 0, 3072)
    assert Progress.from_dict(dataclasses.asdict(rec)) == rec  # what a checkpoint saves now round-trips


def test_after_step_counts_a_step():
    assert Progress().after_step(2, 64).after_step(1, 32) == Progress(2, 3, samples=96)
    assert Progress(1, 1, tokens=10).after_step(1, tokens=5) == Progress(2, 2, tokens=15)


def test_a_positional_count_and_a_bad_record_are_refused():
    with pytest.raises(TypeError):
        Progress(1, 2, 3)  # samples or tokens? said by name
    with pytest.raises(ValueError, match=r"runs/x/step2.*unknown keys \['epoch'\]"):
        Progress.from_dict({"step": 2, "micro_batches": 2, "epoch": 1}, "runs/x/step2")
    with pytest.raises(ValueError, match="step must be a whole number"):
        Progress.from_dict({"step": -1}, "runs/x/step2")
    with pytest.raises(ValueError, match="not a mapping"):
        Progress.from_dict([1, 2], "runs/x/step2")
