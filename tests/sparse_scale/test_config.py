import json
from pathlib import Path

import pytest

from sparse_scale.config import ConfigError, load_config, parse_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def _write(tmp_path, text, name="c.json"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    job = load_config(path)
    assert "train_micro_batch_size_per_gpu" in job.ds
    for name in ("picasso", "moe_proto", "gba"):
        assert name not in job.ds  # plugin blocks are split off DeepSpeed's dict
        assert (name in job.blocks) == (name in json.loads(path.read_text()))


def test_blocks_get_defaults_and_values(tmp_path):
    job = load_config(_write(tmp_path, json.dumps({
        "train_batch_size": 8,
        "gba": {"mode": "auto", "staleness": {"threshold": 2, "decay": "inverse"}},
        "moe_proto": {"num_experts": 16, "num_prototypes": 2},
    })))
    assert job.blocks["gba"].mode == "auto"
    assert job.blocks["gba"].staleness.threshold == 2
    assert job.blocks["gba"].num_servers == 1
    assert job.blocks["moe_proto"].capacity_factor == 1.25
    assert job.block("picasso") is None


def test_misspelt_nested_key_names_file_path_and_nearest(tmp_path):
    p = _write(tmp_path, json.dumps({"picasso": {"cache": {"rows": 10, "polcy": "lfu"}}}))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "picasso.cache.polcy" in msg and "did you mean 'policy'" in msg


def test_bad_value_names_path_and_value(tmp_path):
    p = _write(tmp_path, json.dumps({"gba": {"mode": "fast"}}))
    with pytest.raises(ConfigError, match=r"c\.json: gba\.mode: .*'sync', 'gba' or 'auto'.*\(got 'fast'\)"):
        load_config(p)


def test_negative_value(tmp_path):
    with pytest.raises(ConfigError, match=r"picasso\.cache\.rows: .*greater than 0 \(got -5\)"):
        parse_config({"picasso": {"cache": {"rows": -5}}}, source="x.json")


def test_cross_field_rule_is_reported():
    with pytest.raises(ConfigError, match=r"moe_proto: .*not divisible by num_prototypes=3"):
        parse_config({"moe_proto": {"num_experts": 16, "num_prototypes": 3}})


@pytest.mark.parametrize("typo,meant", [("picaso", "picasso"), ("gba ", "gba"), ("moe-proto", "moe_proto"), ("GBA", "gba")])
def test_misspelt_plugin_block_is_an_error(typo, meant):
    with pytest.raises(ConfigError, match=f"top-level key '{typo}'.*did you mean '{meant}'"):
        parse_config({"train_batch_size": 8, typo: {}}, source="job.json")


def test_misspelt_deepspeed_key_is_an_error():
    with pytest.raises(ConfigError, match="'zero_optimisation'.*did you mean 'zero_optimization'"):
        parse_config({"zero_optimisation": {"stage": 1}})


def test_unrelated_unknown_key_is_kept_with_warning(caplog):
    job = parse_config({"my_experiment_notes": "hello"})
    assert job.ds["my_experiment_notes"] == "hello"
    assert "neither a DeepSpeed key" in caplog.text


def test_duplicate_keys_rejected_json_and_hjson(tmp_path):
    with pytest.raises(ConfigError, match="duplicate key 'gba'"):
        load_config(_write(tmp_path, '{"gba": {}, "gba": {"mode": "auto"}}'))
    with pytest.raises(ConfigError, match="duplicate key 'mode'"):
        load_config(_write(tmp_path, "{\n gba: {mode: sync\n mode: auto}\n}", name="c.hjson"))


def test_hjson_with_comments(tmp_path):
    job = load_config(_write(tmp_path, "{\n  # a comment\n  train_batch_size: 8\n  gba: {\n    mode: auto\n  }\n}", name="c.hjson"))
    assert job.ds == {"train_batch_size": 8} and job.blocks["gba"].mode == "auto"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.json: config file not found"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"bad\.json: not valid json"):
        load_config(_write(tmp_path, '{"a": 1,,}', name="bad.json"))
    with pytest.raises(ConfigError, match="top level must be an object"):
        load_config(_write(tmp_path, "[1, 2]", name="list.json"))
    with pytest.raises(ConfigError, match="gba: must be an object"):
        parse_config({"gba": "auto"})


YAML_CONFIG = ("train_micro_batch_size_per_gpu: 32\noptimizer:\n  type: AdamW\n  params:\n    lr: 0.001\n"
               "gba:\n  mode: auto\n")


@pytest.mark.parametrize("name", ["job.yaml", "job.yml", "JOB.YAML"])
def test_yaml_file_is_refused_at_load_naming_file_and_format(tmp_path, name):
    p = _write(tmp_path, YAML_CONFIG, name=name)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: YAML is not read") and "DeepSpeed configs are JSON or hjson" in msg, msg


@pytest.mark.parametrize("name", ["job.hjson", "job.cfg", "job"])
def test_yaml_text_under_another_suffix_is_refused_not_read_as_strings(tmp_path, name):
    # hjson would give {"optimizer": "type: AdamW", ...}: DeepSpeed then fails on str.keys()
    p = _write(tmp_path, YAML_CONFIG, name=name)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: looks like YAML, which is not read (DeepSpeed configs are JSON or hjson)"), msg
    assert "under 'optimizer'" in msg and "'type: AdamW'" in msg


def test_file_that_parses_to_no_object_names_file_and_formats(tmp_path):
    p = _write(tmp_path, "just some notes\n", name="notes.txt")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: top level must be an object, got str") and "JSON or hjson" in msg, msg


def test_braceless_hjson_with_objects_is_still_read(tmp_path):
    job = load_config(_write(tmp_path, "train_batch_size: 8\ngba: {\n  mode: auto\n}\n", name="c.hjson"))
    assert job.ds == {"train_batch_size": 8} and job.blocks["gba"].mode == "auto"


def test_exponential_decay_with_a_rate_that_never_decays_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"gba\.staleness: .*exponential.*rate < 1.*got 1\.0"):
        parse_config({"gba": {"staleness": {"decay": "exponential", "rate": 1.0}}}, source="job.json")
    ok = parse_config({"gba": {"staleness": {"decay": "inverse", "rate": 2.0}}}).blocks["gba"]  # rate unread there
    assert ok.staleness.rate == 2.0


def test_gba_engine_reads_its_block_without_the_job_registry():
    from gba_engine.startup import load_config as gba_load

    ds, gba, source = gba_load({"train_micro_batch_size_per_gpu": 8, "picasso": {"packing": True},
                                "gba": {"mode": "gba"}})
    assert ds == {"train_micro_batch_size_per_gpu": 8} and gba.mode == "gba" and source == "<dict>"
    with pytest.raises(ConfigError, match="did you mean 'gba'"):
        gba_load({"gbaa": {"mode": "gba"}})
