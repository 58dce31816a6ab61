"""The planner: meta-model counts equal a closed form; the M6-T 1T config fits 480 x 32 GB as configured."""
import json
from pathlib import Path

import pytest

from moe_proto.models import MoETransformerArgs
from moe_proto.plan import Choices, build_meta_model, count_parameters, format_plan, plan_blocks
from sparse_scale.config import ConfigError, load_config
from sparse_scale.lm.plan import main, plan_config

ROOT = Path(__file__).resolve().parents[2]


def closed_form(L, d, f, f_e, V, S, E, every, positions="learned", gated=False):
    """(total, expert) parameters, written from the architecture, not from the code."""
    mats = 3 if gated else 2
    per_block = 4 * d * d + 2 * (2 * d)  # QKV + output projection, two LayerNorms (weight + bias)
    n_moe = L // every if E else 0
    dense_ffn = (L - n_moe) * mats * d * f
    expert = n_moe * E * mats * d * f_e
    router = n_moe * d * E
    total = V * d + (S * d if positions == "learned" else 0) + L * per_block + 2 * d + dense_ffn + router + expert
    return total, expert


@pytest.mark.parametrize("shape", [
    dict(L=4, d=64, f=256, f_e=256, V=257, S=128, E=8, every=2),
    dict(L=6, d=96, f=384, f_e=200, V=300, S=64, E=6, every=3, positions="rotary", gated=True),
    dict(L=3, d=32, f=128, f_e=128, V=257, S=32, E=0, every=1),
    dict(L=24, d=1024, f=4096, f_e=21248, V=257, S=512, E=960, every=1),
])
def test_meta_counts_match_closed_form(shape):
    args = MoETransformerArgs(num_layers=shape["L"], d_model=shape["d"], num_heads=4 if shape["d"] < 1024 else 16,
                              ffn_hidden_size=shape["f"], expert_ffn_hidden_size=shape["f_e"],
                              vocab_size=shape["V"], max_seq_len=shape["S"], num_experts=shape["E"],
                              moe_every=shape["every"], positions=shape.get("positions", "learned"),
                              activation="swiglu" if shape.get("gated") else "gelu")
    counts = count_parameters(build_meta_model(args))
    total, expert = closed_form(**shape)
    assert (counts.total, counts.expert, counts.dense) == (total, expert, total - expert)


def test_one_trillion_config_fits_480_v100_32gb_as_configured():
    plan = plan_config(str(ROOT / "ds_configs" / "m6t_1t.json"), gpus=480, gpu_mem_gb=32)
    assert 0.95e12 < plan.counts.total < 1.1e12
    assert plan.args.ep_size == 480 and plan.expert_params_per_rank == plan.counts.expert / 480
    base = plan.base.choices
    assert (base.precision, base.optimizer, base.offload) == ("fp16", "adafactor", "none")
    assert plan.base.fits and plan.base.total < 32e9
    assert plan.alltoall_bytes_per_step > 0

    def find(**kw):
        (m,) = [a for a in plan.alternatives
                if all(getattr(a.choices, k) == v for k, v in kw.items()) and a.choices.precision == "fp16"]
        return m

    # Adam's two fp32 moments do not fit beside the experts' master weights without offload ...
    assert not find(zero_stage=2, optimizer="adam", offload="none").fits
    # ... and do with ZeRO-Offload.
    assert find(zero_stage=2, optimizer="adam", offload="optimizer").fits
    text = format_plan(plan)
    assert "DOES NOT FIT" in text and "FIT in 32 GB" in text


def test_one_trillion_config_does_not_fit_on_fewer_smaller_gpus():
    assert main([str(ROOT / "ds_configs" / "m6t_1t.json"), "--gpus", "480", "--gpu-mem", "16"]) == 1


@pytest.mark.parametrize("name,gpus,mem", [("m6t_10b.json", 8, 32), ("m6t_100b.json", 128, 32)])
def test_10b_and_100b_configs_validate_and_plan(name, gpus, mem, capsys):
    plan = plan_config(str(ROOT / "ds_configs" / name), gpus=gpus, gpu_mem_gb=mem)
    target = 1e10 if "10b" in name else 1e11
    assert 0.9 * target < plan.counts.total < 1.1 * target
    assert plan.base.fits
    assert main([str(ROOT / "ds_configs" / name), "--gpus", str(gpus), "--gpu-mem", str(mem)]) == 0
    assert "parameters: total" in capsys.readouterr().out


def test_plan_blocks_is_plan_config_without_the_file():
    path = str(ROOT / "ds_configs" / "m6t_10b.json")
    job = load_config(path)
    blocks = plan_blocks(job.ds, job.blocks["moe_model"], job.blocks.get("moe_proto"), gpus=8, gpu_mem_gb=32,
                         source=path)
    assert blocks == plan_config(path, gpus=8, gpu_mem_gb=32)
    with pytest.raises(ValueError, match="does not divide"):
        plan_blocks(job.ds, job.blocks["moe_model"], job.blocks["moe_proto"], gpus=7, gpu_mem_gb=32)
    with pytest.raises(ConfigError, match="does not divide --gpus 7"):
        plan_config(path, gpus=7, gpu_mem_gb=32)


def test_zero_stages_partition_what_they_should():
    args = MoETransformerArgs(num_layers=2, d_model=64, num_heads=4, ffn_hidden_size=256, num_experts=8, moe_every=1)
    counts = count_parameters(build_meta_model(args))
    from moe_proto.plan import plan_memory

    mem = {s: plan_memory(counts, args, Choices(s, "fp16", "adam", "none", False), gpus=8, ep_size=4,
                          micro_batch=1, gpu_mem_gb=80) for s in range(4)}
    assert mem[0].optimizer > mem[1].optimizer and mem[1].grads > mem[2].grads and mem[2].params > mem[3].params
    # Experts are split over ep=4 and their optimizer state over the 2 expert-data-parallel ranks.
    assert mem[1].optimizer == pytest.approx(12 * (counts.dense / 8 + counts.expert / 4 / 2))


def test_plan_rejects_gpus_not_divisible_by_ep_size(tmp_path):
    cfg = json.loads((ROOT / "ds_configs" / "m6t_10b.json").read_text())
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not divide"):
        plan_config(str(path), gpus=12, gpu_mem_gb=32)
