"""Checkpoints that survive: staged saves with a manifest, verified resumes with fallback, full disks reported."""
import errno
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from sparse_scale import atomic_checkpoint as atomic
from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--eval-samples", "512", "--vocab", "200", "--threads", "1"]


def _stage(ckpt: Path, tag: str, files: dict[str, bytes]) -> Path:
    staging = atomic.begin(ckpt, tag)
    for name, data in files.items():
        (staging / tag / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / tag / name).write_bytes(data)
    (staging / "latest").write_text(tag)  # what an engine writes: must never become the real pointer
    return atomic.commit(ckpt, tag)


def test_commit_writes_manifest_renames_and_moves_latest(tmp_path):
    ckpt = tmp_path / "ck"
    final = _stage(ckpt, "step2", {"model.pt": b"a" * 100, "sub/opt.pt": b"b" * 7})
    assert final == ckpt / "step2" and (ckpt / "latest").read_text() == "step2"
    manifest = json.loads((final / atomic.MANIFEST).read_text())
    assert manifest["files"]["sub/opt.pt"]["bytes"] == 7 and manifest["total_bytes"] == 107
    assert not (ckpt / atomic.STAGING / "step2").exists() and not (ckpt / atomic.STAGING / "latest").exists()
    atomic.verify(final)
    _stage(ckpt, "step2", {"model.pt": b"c" * 5})  # the same tag again replaces the old folder whole
    assert json.loads((final / atomic.MANIFEST).read_text())["total_bytes"] == 5
    assert atomic.select(ckpt) == atomic.Choice("step2", [])


def test_broken_latest_falls_back_to_the_newest_intact_and_is_repaired(tmp_path):
    ckpt = tmp_path / "ck"
    for step in (2, 4, 6):
        _stage(ckpt, f"step{step}", {"model.pt": bytes(range(50)) * step})
    with open(ckpt / "step6" / "model.pt", "r+b") as f:
        f.truncate(10)
    choice = atomic.select(ckpt)
    assert choice.tag == "step4"
    text = " ".join(choice.warnings)
    assert "step6/model.pt has 10 bytes, the manifest says 300 (truncated?)" in text
    assert "resuming from the newest intact checkpoint" in text and (ckpt / "latest").read_text() == "step4"

    (ckpt / "latest").write_text("step9")  # dangling: names a folder that is gone
    (ckpt / "step4" / "model.pt").write_bytes(b"x" * 200)  # same size, other bytes: the crc finds it
    choice = atomic.select(ckpt)
    assert choice.tag == "step2" and (ckpt / "latest").read_text() == "step2"
    assert any("step9 does not exist" in w for w in choice.warnings)
    assert any("step4/model.pt is corrupt" in w for w in choice.warnings)

    (ckpt / "step2" / atomic.MANIFEST).unlink()
    with pytest.raises(atomic.NoIntactCheckpointError, match=r"step2/MANIFEST.json is missing"):
        atomic.select(ckpt)
    assert atomic.select(tmp_path / "empty") == atomic.Choice(None, [])


def test_no_space_message_and_detection():
    assert atomic.is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file: "
                           "file write failed")
    assert atomic.is_no_space(wrapped) and not atomic.is_no_space(ValueError("other"))
    assert atomic.no_space_message(Path("/tmp"), 5_000_000).startswith("no space left on /tmp: need ~5.0 MB")


def _full_disk(save_dir: Path) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_no_space_message_names_the_previous_checkpoint_or_says_there_is_none(tmp_path):
    ckpt = tmp_path / "ck"
    with pytest.raises(atomic.NoSpaceError) as info:  # the first save of a run
        atomic.staged_save(ckpt, "step2", _full_disk, 10)
    assert "no checkpoint was written yet, so there is nothing to resume from" in str(info.value)
    assert "intact" not in str(info.value)

    _stage(ckpt, "step2", {"model.pt": b"a" * 10})
    _stage(ckpt, "step4", {"model.pt": b"b" * 10})
    with pytest.raises(atomic.NoSpaceError) as info:
        atomic.staged_save(ckpt, "step6", _full_disk, 10)
    assert f"the previous checkpoint {ckpt / 'step4'} is intact (free space" in str(info.value)
    assert atomic.latest_checkpoint(ckpt) == ckpt / "step4" and not (ckpt / atomic.STAGING / "step6").exists()

    (ckpt / "latest").unlink()  # no pointer: the newest finished folder is what a resume takes
    assert f"the previous checkpoint {ckpt / 'step4'} is intact" in atomic.no_space_message(ckpt, 10, free=0)
    assert atomic.latest_checkpoint(tmp_path / "missing") is None


# --- real rec jobs --------------------------------------------------------------------------------------------

def _config(tmp_path: Path) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 32
    cfg["wandb"] = {"enabled": False}
    cfg["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=100)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _train(rank, world_size, argv, patch_space=None):
    """One rec job through the CLI's code path; its summary, or the job error's message."""
    import logging
    import os

    os.environ["WANDB_MODE"] = "offline"
    from sparse_scale.rec import checkpoint, cli
    from sparse_scale.rec.config import RecJobError

    if patch_space == "skip_precheck":  # the estimate is too low: the write itself meets the full disk
        checkpoint.atomic.check_space = lambda ckpt_dir, need: None
    elif patch_space and patch_space.startswith("simulate"):  # no tmpfs (not root): torch fails as a full disk does
        import torch

        real_save, calls = torch.save, {"n": 0}
        fits = int(patch_space.partition(":")[2] or 2)  # writes that fit before the disk is full

        def failing_save(obj, f, *args, **kwargs):
            if ".partial" in str(f):
                calls["n"] += 1
                if calls["n"] > fits:
                    raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
            return real_save(obj, f, *args, **kwargs)

        checkpoint.atomic.check_space = lambda ckpt_dir, need: None
        torch.save = failing_save
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sparse_scale.rec.notice").addHandler(handler)
    try:
        summary = cli.train(cli.parse_args(argv))
    except RecJobError as exc:
        return {"error": str(exc), "notices": lines}
    return {"steps": summary["steps"], "checkpoint": summary["checkpoint"], "notices": lines}


def _job(tmp_path, out, steps, *extra, patch_space=None, ranks=1):
    argv = [*SMALL, "--config", _config(tmp_path), "--out", str(out), "--steps", str(steps), *extra]
    return run_distributed(_train, ranks, args=(argv, patch_space), timeout_s=40, init_process_group=False)[0]


def test_rec_resume_verifies_and_falls_back_past_a_truncated_checkpoint(tmp_path):
    out = tmp_path / "run"
    first = _job(tmp_path, out, 6, "--save-every", "2", ranks=2)
    ckpt = out / "checkpoints"
    assert first["steps"] == 6 and (ckpt / "latest").read_text() == "step6"
    for step in (2, 4, 6):
        atomic.verify(ckpt / f"step{step}")  # every folder has its manifest and passes it
    victim = max((p for p in (ckpt / "step6").rglob("*.pt")), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    resumed = _job(tmp_path, out, 8, "--resume", ranks=2)
    text = "\n".join(resumed["notices"])
    assert f"{victim.relative_to(out).as_posix()} has" in text.replace(str(out) + "/", ""), text
    assert "resuming from the newest intact checkpoint" in text and "resumed from" in text and "step4" in text
    assert resumed["steps"] == 8 and (ckpt / "latest").read_text() == "step8"

    import shutil

    shutil.rmtree(ckpt / "step8")  # a dangling latest: repaired from the intact step folders
    again = _job(tmp_path, out, 8, "--resume", ranks=2)
    assert any("'latest' names 'step8'" in n for n in again["notices"]) and again["steps"] == 8
    for folder in ("step2", "step4", "step6"):
        (ckpt / folder / atomic.MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(ckpt / "step8")
    broken = _job(tmp_path, out, 9, "--resume", ranks=2)
    assert "no intact checkpoint in" in broken["error"] and "MANIFEST.json is missing" in broken["error"]


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs (root only); None where it cannot be mounted (then the full disk is simulated in-process)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True).returncode == 0
    yield mount if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("where", ["precheck", "write", "simulated"])
def test_full_disk_is_reported_and_keeps_the_previous_checkpoint(tmp_path, small_disk, where):
    """precheck: the free-space check refuses; write: the write itself fails on the tmpfs; simulated: ENOSPC in-process."""
    real = small_disk is not None and where != "simulated"
    out = (small_disk if real else tmp_path) / "run"
    patch = "simulate" if not real else (None if where == "precheck" else "skip_precheck")
    # one checkpoint of this model is ~3.7 MB: the first save fits, the second does not
    got = _job(tmp_path, out, 6, "--save-every", "3", "--embedding-dim", "16", patch_space=patch)
    assert "error" in got, got
    assert got["error"].startswith(f"no space left on {out / 'checkpoints'}: need ~"), got["error"]
    ckpt = out / "checkpoints"
    assert "MB" in got["error"] and f"the previous checkpoint {ckpt / 'step3'} is intact" in got["error"]
    assert (ckpt / "latest").read_text() == "step3"
    atomic.verify(ckpt / "step3")
    assert not (ckpt / "step6").exists()
    assert not (ckpt / atomic.STAGING / "step6").exists()  # the half-written step folder is gone


def test_full_disk_at_the_first_save_says_there_is_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    got = _job(tmp_path, out, 6, "--save-every", "3", patch_space="simulate:0")
    assert "error" in got, got
    assert got["error"].startswith(f"no space left on {out / 'checkpoints'}: need ~"), got["error"]
    assert "no checkpoint was written yet, so there is nothing to resume from" in got["error"], got["error"]
    assert "intact" not in got["error"] and not (out / "checkpoints" / "latest").exists()


# --- the MoE LM job ---------------------------------------------------------------------------------------------

def _lm(rank, world_size, fields):
    import logging
    import os

    os.environ["WANDB_MODE"] = "offline"
    from sparse_scale.lm import LMJobConfig, run

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sparse_scale.lm").addHandler(handler)
    logging.getLogger("sparse_scale.lm").setLevel(logging.INFO)  # "resumed from ..." is an INFO line
    return {"steps": run(LMJobConfig(**fields)).steps, "logged": lines}


def test_lm_checkpoints_carry_manifests_and_resume_falls_back(tmp_path):
    from tests.e2e.test_train_moe_lm import _config as lm_config, _data, _job as lm_job

    data, cfg, out = _data(tmp_path), lm_config(tmp_path), tmp_path / "lm"
    run_distributed(_lm, 1, args=(lm_job(cfg, data, out, 4, save_every=2),), timeout_s=40, init_process_group=False)
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "step4"
    atomic.verify(ckpt / "step2")
    (ckpt / "step4" / "moe_proto" / "dense.pt").unlink()  # what a crash mid-copy or a lost file leaves
    got = run_distributed(_lm, 1, args=(lm_job(cfg, data, out, 5, resume=True),), timeout_s=40,
                          init_process_group=False)[0]
    text = "\n".join(got["logged"])
    assert "step4/moe_proto/dense.pt is missing" in text and "resuming from the newest intact checkpoint" in text
    assert "resumed from" in text and "step2" in text and got["steps"] == 5
    assert (ckpt / "latest").read_text() == "step5"
