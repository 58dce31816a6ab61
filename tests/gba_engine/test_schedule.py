"""ServerLRSchedule: the learning rate of update u equals what DeepSpeed's engine uses at its step u."""
import pytest
import torch

from gba_engine.ps.schedule import ServerLRSchedule

BLOCKS = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 5}},
    {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 4, "total_num_steps": 12,
                                         "warmup_type": "linear"}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 3}},
    {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2}},
]


@pytest.mark.parametrize("block", BLOCKS, ids=[b["type"] for b in BLOCKS])
def test_matches_deepspeed_stepping_after_every_optimizer_step(block):
    from deepspeed.runtime import lr_schedules

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    ds = getattr(lr_schedules, block["type"])(opt, **block["params"])
    used = []
    for _ in range(14):  # DeepSpeed's engine: optimizer.step() with the current lr, then lr_scheduler.step()
        used.append(opt.param_groups[0]["lr"])
        ds.step()
    sched = ServerLRSchedule(block, base_lr=0.01)
    assert [sched.lr(u) for u in range(14)] == pytest.approx(used, rel=1e-12, abs=0)
    assert sched.lr(3) == pytest.approx(used[3])  # any order: a pure function of the update number
    assert len(set(used)) > 2  # the schedule moves


def test_refused_schedules_say_why():
    with pytest.raises(ValueError, match="OneCycle also cycles momentum"):
        ServerLRSchedule({"type": "OneCycle", "params": {}}, base_lr=0.01)
    with pytest.raises(ValueError, match="scheduler 'WarmupLR'"):
        ServerLRSchedule({"type": "WarmupLR", "params": {"warmup_steps": 3}}, base_lr=0.01)
    with pytest.raises(ValueError, match="update must be >= 0"):
        ServerLRSchedule(BLOCKS[0], base_lr=0.01).lr(-1)
