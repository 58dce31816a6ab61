"""benchmarks/real_data.py on a tiny synthetic frame: split and ids, the Criteo TSV our reader takes, the
baselines' rows, the table and the verdict (deepctr rows skipped where deepctr-torch is not installed)."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from picasso_ops.data.criteo import CriteoTSVReader

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_real_data", ROOT / "benchmarks" / "real_data.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


rd = _load()


def tiny_frame(n: int = 600, seed: int = 0):
    """A frame whose label depends on one categorical column and one dense column, so models can learn it."""
    rng = np.random.default_rng(seed)
    color = rng.choice(np.array(["red", "green", "blue", "grey"], dtype=object), n)
    shape = rng.choice(np.array(["a", "b", None], dtype=object), n)
    count = rng.integers(0, 50, n)
    logit = np.where(color == "red", 3.0, -1.5) + np.where(shape == "a", 1.0, 0.0) + count / 50 - 0.5
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"color": color, "shape": shape}, {"count": count, "zero": np.zeros(n, np.int64)}, label


def tiny_dataset(n: int = 600):
    cat, dense, label = tiny_frame(n)
    cut = int(0.8 * n)
    return rd.build_dataset("tiny", cat, dense, label, np.arange(cut), np.arange(cut, n))


def test_ids_come_from_the_training_split():
    train, test = rd.encode_columns({"a": np.array(["x", "y", None, ""], dtype=object)},
                                    {"a": np.array(["y", "z", None], dtype=object)})
    assert train[:, 0].tolist() == [2, 3, 0, 0]  # sorted values from 2; missing -> 0
    assert test[:, 0].tolist() == [3, 1, 0]  # unseen in training -> 1
    with pytest.raises(rd.BenchmarkError, match="differ"):
        rd.encode_columns({"a": np.array(["x"], dtype=object)}, {"b": np.array(["x"], dtype=object)})


def test_split_is_fixed_and_keeps_every_row():
    a, b = tiny_dataset(), tiny_dataset()
    assert len(a.train) == 480 and len(a.test) == 120
    assert np.array_equal(a.train.cat, b.train.cat) and np.array_equal(a.train.label, b.train.label)
    cat, dense, label = tiny_frame()
    assert sorted(a.train.label.tolist() + a.test.label.tolist()) == sorted(label.tolist())
    assert a.test.label.tolist() == label[480:].tolist()  # the test rows keep their order (a time split stays one)
    with pytest.raises(rd.BenchmarkError, match="Criteo layout"):
        rd.Split(np.zeros((2, 27), np.int64), np.zeros((2, 1), np.int64), np.zeros(2, np.float32))
    with pytest.raises(rd.BenchmarkError, match=">= 0"):
        rd.Split(np.zeros((2, 1), np.int64), -np.ones((2, 1), np.int64), np.zeros(2, np.float32))


def test_movielens_and_adult_frames_follow_the_documented_columns():
    ratings = {"user_id": np.array([2, 1, 1]), "movie_id": np.array([10, 10, 11]), "rating": np.array([4, 3, 5]),
               "timestamp": np.array([300, 100, 100])}
    users = {"user_id": np.array([1, 2]), "age": np.array([24, 53]), "gender": np.array(["M", "F"], dtype=object),
             "occupation": np.array(["writer", "other"], dtype=object),
             "zip_code": np.array(["85711", "94043"], dtype=object)}
    genres = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
              "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western"]
    items = {"movie_id": np.array([10, 11]), "movie_title": np.array(["A", "B"], dtype=object),
             "release_date": np.array(["01-Jan-1995", None], dtype=object), "video_release_date": np.array([None, None]),
             "IMDb_URL": np.array(["", ""], dtype=object), **{g: np.array([1 if g == "Action" else 0, 0]) for g in genres}}
    cat, dense, label = rd.movielens_frames(ratings, users, items)
    assert len(cat) == 26 and list(dense) == ["age", "year_since_1900", "hour", "weekday"]
    assert cat["user"].tolist() == ["1", "1", "2"] and cat["item"].tolist() == ["10", "11", "10"]  # by time, user, item
    assert label.tolist() == [0.0, 1.0, 1.0]
    assert cat["genre_Action"].tolist() == ["Action", None, "Action"] and cat["year"].tolist() == ["1995", None, "1995"]
    assert dense["year_since_1900"].tolist() == [95, 0, 95] and cat["zip3"].tolist() == ["857", "857", "940"]
    adult = {"age": np.array([25, 38]), "workclass": np.array(["Private", "?"], dtype=object),
             "fnlwgt": np.array([1, 2]), "education": np.array(["11th", "HS-grad"], dtype=object),
             "educational-num": np.array([7, 9]), "marital-status": np.array(["x", "y"], dtype=object),
             "occupation": np.array(["o", "p"], dtype=object), "relationship": np.array(["r", "s"], dtype=object),
             "race": np.array(["w", "b"], dtype=object), "gender": np.array(["Male", "Female"], dtype=object),
             "capital-gain": np.array([0, 5]), "capital-loss": np.array([0, 0]), "hours-per-week": np.array([40, 50]),
             "native-country": np.array(["US", "US"], dtype=object), "income": np.array(["<=50K", ">50K"], dtype=object)}
    cat, dense, label = rd.adult_frames(adult)
    assert len(cat) == 10 and len(dense) == 6 and label.tolist() == [0.0, 1.0]
    assert cat["workclass"].tolist() == ["Private", None] and cat["hours_bucket"].tolist() == ["4", "5"]
    with pytest.raises(rd.BenchmarkError, match="income"):
        rd.adult_frames({**adult, "income": np.array(["<=50K", "maybe"], dtype=object)})


def test_the_tsv_is_what_our_reader_takes(tmp_path):
    data = tiny_dataset()
    path = rd.write_criteo_tsv(data.test, tmp_path / "test.tsv")
    reader = CriteoTSVReader([path], batch_size=len(data.test), vocab_sizes=1000, max_bad_fraction=0.0)
    (batch,) = list(reader)
    assert batch.labels.tolist() == data.test.label.tolist()
    # the dense columns (log1p), then the padding of the 13 integer columns as 0
    expected = np.log1p(data.test.dense.astype(np.float64))
    assert np.allclose(batch.dense[:, :2].numpy(), expected, atol=1e-6) and not batch.dense[:, 2:].any()
    # an id where the frame has one, none where it is missing, and the 24 padded fields are empty
    assert batch.lengths[:2].tolist() == (data.test.cat.T > 0).astype(int).tolist()
    assert not batch.lengths[2:].any()


def test_the_schema_tsv_reads_with_its_schema(tmp_path):
    from picasso_ops.data.schema import DataSchema

    cat, dense, label = tiny_frame(200)
    cat["g1"] = np.where(cat["color"] == "red", "x", None).astype(object)  # two columns of one multi-hot field
    cat["g2"] = np.where(dense["count"] > 25, "y", None).astype(object)
    data = rd.build_dataset("tiny", cat, dense, label, np.arange(160), np.arange(160, 200),
                            multi_hot={"g": ["g1", "g2"]})
    path, schema = rd.write_schema_tsv(data, data.test, tmp_path / "test.tsv")
    assert path.read_text().splitlines()[0].split("\t") == ["label", "count", "zero", "color", "shape", "g"]
    reader = CriteoTSVReader([path], batch_size=40, vocab_sizes=1000, max_bad_fraction=0.0,
                             schema=DataSchema(**schema))
    (batch,) = list(reader)
    assert batch.labels.tolist() == data.test.label.tolist()
    assert np.allclose(batch.dense.numpy(), np.log1p(data.test.dense.astype(np.float64)), atol=1e-6)
    present = (data.test.cat > 0).astype(int)
    assert batch.lengths.tolist() == [*present[:, :2].T.tolist(), present[:, 2:].sum(1).tolist()]


def test_baselines_learn_and_the_table_reports_them(tmp_path):
    torch.manual_seed(0)
    data = tiny_dataset(2000)
    models = ["lr", "fm", "deepctr_deepfm"]
    results = rd.run_benchmark([data], models, epochs=2, workroot=tmp_path, lrs={"lr": 0.1, "fm": 0.05})
    rows = {r.model: r for r in results["tiny"]}
    for name in ("lr", "fm"):
        r = rows[name]
        assert [e.epoch for e in r.epochs] == [0, 1]
        assert r.best.auc > 0.7 and math.isfinite(r.best.log_loss)  # the planted signal is learnt
    if rd.deepctr_available():
        assert len(rows["deepctr_deepfm"].epochs) == 2
    else:
        assert rows["deepctr_deepfm"].epochs == [] and "not installed" in rows["deepctr_deepfm"].note
    table = rd.markdown_table(results)
    assert table.count("\n") == 1 + len(models) and "| tiny | lr | " in table
    kept = rd.ModelResult("ours_x", [rd.EpochResult(0, 0.7, 0.5)], 1.0, "", {"epoch": 0, "auc": 0.7, "log_loss": 0.5})
    assert "| epoch 1: 0.7000, 0.5000 |" in rd.markdown_table({"tiny": [kept]})
    cfg = json.loads((tmp_path / "tiny" / "ours_config.json").read_text())
    assert cfg["wandb"]["enabled"] is False


def test_verdict_and_config_overrides(tmp_path):
    E = rd.EpochResult
    rows = [rd.ModelResult("lr", [E(0, 0.70, 0.6)], 1.0), rd.ModelResult("fm", [E(0, 0.72, 0.6)], 1.0),
            rd.ModelResult("deepctr_dcn", [E(0, 0.75, 0.5)], 1.0),
            rd.ModelResult("ours_dlrm", [E(0, 0.73, 0.5), E(1, 0.749, 0.55)], 1.0),
            rd.ModelResult("ours_wide_deep", [E(0, 0.71, 0.5)], 1.0)]
    v = rd.verdict(rows)
    assert v == {"ours_best": "ours_dlrm", "beats_lr": True, "beats_fm": True, "level_with_peer": True,
                 "vs_peer": -0.001}
    assert rd.verdict(rows, level=0.0005)["level_with_peer"] is False
    assert rd.parse_override("picasso.optimizer.lr=0.02") == ("picasso.optimizer.lr", 0.02)
    path = rd.ours_config(ROOT / "ds_configs" / "rec_picasso_cpu.json",
                          [("picasso.optimizer.lr", 0.02), ("optimizer.params.weight_decay", 1e-5)], tmp_path)
    cfg = json.loads(path.read_text())
    assert cfg["picasso"]["optimizer"]["lr"] == 0.02 and cfg["optimizer"]["params"]["weight_decay"] == 1e-5
    with pytest.raises(rd.BenchmarkError, match="not a block"):
        rd.set_key({"a": 1}, "a.b", 2)


@pytest.mark.soak
def test_our_job_runs_on_the_benchmark_files(tmp_path):
    """Our model through ``python -m sparse_scale.rec`` on the written TSV files, per-epoch metrics read back."""
    data = tiny_dataset(1200)
    cfg = rd.ours_config(ROOT / "ds_configs" / "rec_picasso_cpu.json", [], tmp_path)
    flags = ("--early-stop-metric", "logloss", "--patience", "0")
    epochs, kept = rd.train_ours("deepfm", data, 2, cfg, tmp_path, rd.OursSettings(vocab=20000, flags=flags,
                                                                                   timeout_s=150))
    assert [e.epoch for e in epochs] == [0, 1]
    # 8 steps inside the config's 100-step warm-up: too few to learn, enough to score and keep
    assert all(0.0 <= e.auc <= 1.0 and math.isfinite(e.log_loss) for e in epochs)
    assert kept["log_loss"] == min(e.log_loss for e in epochs)  # the kept checkpoint is the run's best log loss
