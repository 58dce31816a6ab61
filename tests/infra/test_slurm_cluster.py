"""The test Slurm cluster's client wrapper: transient client deaths are retried, real failures are not."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from tests.infra.slurm_cluster import SlurmCluster, SlurmClusterError


def _cluster(tmp_path: Path, replies: list[tuple[int, str, str]], calls: list[list[str]]) -> SlurmCluster:
    fields = {f.name: None for f in dataclasses.fields(SlurmCluster) if f.init and f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING}
    cluster = SlurmCluster(**{**fields, "root": tmp_path})

    def run(args, timeout_s=30.0, check=True, **kw):
        calls.append(list(args))
        code, out, err = replies.pop(0)
        return subprocess.CompletedProcess(args, code, out, err)

    cluster.run = run  # type: ignore[method-assign]
    return cluster


def test_scontrol_killed_by_sigpipe_is_retried(tmp_path, monkeypatch):
    """Seen in a fresh clone: `scontrol show job` exited -13 (SIGPIPE) once; the next poll works."""
    monkeypatch.setattr("tests.infra.slurm_cluster.time.sleep", lambda s: None)
    calls: list[list[str]] = []
    cluster = _cluster(tmp_path, [(-13, "", ""), (1, "", "Unable to contact slurm controller"),
                                  (0, "JobId=7 JobState=COMPLETED ExitCode=0:0", "")], calls)
    assert cluster.job_info("7") == {"JobId": "7", "JobState": "COMPLETED", "ExitCode": "0:0"}
    assert len(calls) == 3


def test_scontrol_real_error_is_not_retried(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.infra.slurm_cluster.time.sleep", lambda s: None)
    calls: list[list[str]] = []
    cluster = _cluster(tmp_path, [(1, "", "slurm_load_jobs error: Invalid job id specified")], calls)
    with pytest.raises(SlurmClusterError, match="Invalid job id"):
        cluster.job_info("99")
    assert len(calls) == 1


def test_scontrol_that_keeps_dying_is_reported_with_its_exit_code(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.infra.slurm_cluster.time.sleep", lambda s: None)
    calls: list[list[str]] = []
    cluster = _cluster(tmp_path, [(-13, "", "")] * 5, calls)
    with pytest.raises(SlurmClusterError, match=r"exited -13 \(5 tries\)"):
        cluster.job_info("7")
    assert len(calls) == 5
