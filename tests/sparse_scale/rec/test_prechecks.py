"""Bad --out, run folders, data files and config files are refused before step 1, naming what is wrong."""
import gzip
import json
from pathlib import Path

import pytest

from picasso_ops.data.quality import DataError
from picasso_ops.data.rows import check_readable
from sparse_core.config_file import ConfigError, read_config_file, split_config
from sparse_scale.rec import cli
from sparse_scale.rec.config import RecJobConfig, RecJobError
from sparse_scale.rec.faults import Straggler

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "ds_configs" / "demo_cpu.json")


def _main_error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code not in (0, None)
    return str(info.value.code)


def test_out_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "out"
    out.write_text("x")
    assert "is not a folder" in _main_error(["--config", DEMO, "--out", str(out)])


def test_existing_run_folder_needs_resume_or_overwrite(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step6")
    message = _main_error(["--config", DEMO, "--out", str(tmp_path)])
    assert str(tmp_path) in message and "--overwrite" in message
    cli.check_out_folder(tmp_path, resume=False, overwrite=True)
    cli.check_out_folder(tmp_path, resume=True, overwrite=False)


@pytest.mark.parametrize("content, words", [(b"", "empty"), (gzip.compress(b"0\t1\n"), "gzip-compressed")])
@pytest.mark.parametrize("flag", ["--train-files", "--eval-files"])
def test_empty_and_gzip_data_files_are_refused_before_training(tmp_path, content, words, flag):
    bad, good = tmp_path / "bad.tsv", tmp_path / "good.tsv"
    bad.write_bytes(content)
    good.write_text("1\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n")
    files = {"--train-files": good, "--eval-files": good, flag: bad}
    message = _main_error(["--config", DEMO, "--out", str(tmp_path / "out"), "--data", "criteo",
                           "--train-files", str(files["--train-files"]), "--eval-files", str(files["--eval-files"])])
    assert flag in message and words in message and str(bad) in message


def test_check_readable_names_the_file():
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        check_readable(["nope.tsv"], "Criteo TSV")


def test_directory_as_data_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="not a regular file"):
        check_readable([tmp_path], "parquet")


def test_straggler_and_crash_rank_out_of_range():
    job = RecJobConfig(config=DEMO, stragglers=(Straggler(9, 4.0),))
    with pytest.raises(RecJobError, match=r"--straggler: rank 9 is out of range.*0\.\.0"):
        cli.check_stragglers(job, world_size=1)
    cli.check_stragglers(RecJobConfig(config=DEMO, stragglers=(Straggler(1, 4.0),)), world_size=2)


def test_binary_config_file_names_the_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(ConfigError, match=r"cfg\.json: not a text \(UTF-8\) config file"):
        read_config_file(path)


@pytest.mark.parametrize("value", ["8", 0, True, 2.5])
def test_non_integer_batch_sizes_name_the_key(value):
    with pytest.raises(ConfigError, match=r"c\.json: train_micro_batch_size_per_gpu must be a whole number"):
        split_config({"train_micro_batch_size_per_gpu": value}, source="c.json")


def test_string_micro_batch_in_a_file_is_a_clear_cli_error(tmp_path):
    cfg = json.loads(Path(DEMO).read_text())
    cfg["train_micro_batch_size_per_gpu"] = "8"
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="train_micro_batch_size_per_gpu"):
        cli.main(["--config", str(path), "--out", str(tmp_path / "out")])


def _outside_and_edge(info) -> list[tuple[float, float]]:
    """(a value the Field bound refuses, the nearest value it accepts) for each bound of a SyntheticConfig field."""
    pairs = []
    for item in info.metadata:
        for key, step in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
            bound = getattr(item, key, None)
            if bound is not None:
                inside = bound if key in ("ge", "le") else bound + (0.5 if key == "gt" else -0.5)
                pairs.append((bound + step if step else bound, inside))
    return pairs


@pytest.mark.parametrize("attr", sorted(__import__("sparse_scale.rec.config", fromlist=["x"]).SYNTHETIC_FLAGS))
def test_every_synthetic_flag_bound_is_refused_by_job_config_naming_the_flag(attr):
    """Each Field bound of the synthetic stream, one step outside: the flag is named, before any training."""
    from picasso_ops.data.synthetic import SyntheticConfig
    from sparse_scale.rec.config import SYNTHETIC_FLAGS

    flag, field = SYNTHETIC_FLAGS[attr]
    pairs = _outside_and_edge(SyntheticConfig.model_fields[field])
    if attr == "vocab":  # checked by the model's validator: [1, MAX_VOCAB]
        from picasso_ops.data.zipf import MAX_VOCAB
        pairs = [(MAX_VOCAB + 1, MAX_VOCAB)]
    if attr == "max_hot":
        pairs = [(1025, 1024)]
    assert pairs, f"{field}: no bound found"
    for outside, edge in pairs:
        cast = float if attr == "zipf" else int
        with pytest.raises(RecJobError) as info:
            cli.job_config(cli.parse_args(["--config", DEMO, flag, str(cast(outside))]))
        message = str(info.value)
        assert message.startswith(f"{flag} {cast(outside)}: must "), message
        assert "Input should" not in message and "pydantic" not in message, message
        assert cli.job_config(cli.parse_args(["--config", DEMO, flag, str(cast(edge))])).synthetic_config()


def test_fields_5_is_refused_before_the_job_starts(monkeypatch, tmp_path):
    from sparse_scale.rec import runner

    def never(*args, **kwargs):
        raise AssertionError("the job started")

    monkeypatch.setattr(runner, "job_context", never)
    message = _main_error(["--config", DEMO, "--out", str(tmp_path / "out"), "--fields", "5"])
    assert message == "--fields 5: must be >= 26 (the synthetic stream's 26 <= num_fields <= 1000)"


def test_synthetic_bounds_do_not_apply_to_file_data(tmp_path):
    job = RecJobConfig(config=DEMO, data="criteo", train_files=("a",), eval_files=("b",), seed=-1)
    assert job.synthetic_config() is None
