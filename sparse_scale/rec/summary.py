"""What a recommender job reports: :class:`RecSummary` (summary.json) and the summary table's rows.

Example::

    summary.to_dict()              # the keys of OUT/summary.json
    print_table(summary_rows(summary.to_dict()))
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RecSummary:
    """One worker's result of :func:`sparse_scale.rec.run`; ``to_dict()`` is what rank 0 writes to summary.json."""

    model: str
    world_size: int
    launcher: str
    steps: int
    samples: int  # the job's samples (with claimed batches: summed over the workers)
    samples_per_s: float
    train_time_s: float
    local_samples: int  # this rank's, this run
    metrics: dict[str, float]  # auc, log_loss, eval_samples, and with a planted teacher bayes_auc, bayes_log_loss
    checkpoint: str
    wandb_mode: str | None
    wandb_dir: str | None
    eval_history: list[dict[str, float]]
    picasso: dict[str, Any] | None = None  # cache hit rate (training lookups), micro-batches
    gba: dict[str, Any] | None = None  # mode, switches and their cost, staleness, per-worker samples/s
    moe: dict[str, Any] | None = None  # MoE tower: experts and each layer's load (sparse_scale.rec.moe_tower)
    best: dict[str, Any] | None = None  # --early-stop-metric: the best evaluation, its checkpoint, the early stop

    is_server = False

    def to_dict(self) -> dict[str, Any]:
        """summary.json's mapping: the metrics inline, the picasso and gba parts only when the job had the block."""
        out: dict[str, Any] = {
            "model": self.model, "world_size": self.world_size, "launcher": self.launcher, "steps": self.steps,
            "samples": self.samples, "samples_per_s": self.samples_per_s, "train_time_s": self.train_time_s,
            "local_samples": self.local_samples, **self.metrics, "checkpoint": self.checkpoint,
            "wandb_mode": self.wandb_mode, "wandb_dir": self.wandb_dir, "eval_history": self.eval_history,
        }
        if self.picasso is not None:
            out["picasso"] = self.picasso
        if self.moe is not None:
            out["moe"] = self.moe
        if self.gba is not None:
            out["gba"] = self.gba
        if self.best is not None:
            out["best"] = self.best
        return out


@dataclasses.dataclass(frozen=True)
class ServerSummary:
    """A parameter-server rank's result: it served the job and trained nothing itself."""

    stats: dict[str, Any]

    is_server = True

    def to_dict(self) -> dict[str, Any]:
        return {"server": True, "gba_server": self.stats}


def moe_rows(m: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Summary-table rows of an MoE tower: its experts, then each layer's dropped fraction and load per expert."""
    if not m:
        return []
    rows = [("moe experts", f"{m['num_experts']} ({m['num_prototypes']} prototype(s) x top-{m['top_k']}), "
                            f"{m['experts']}, ep_size {m['ep_size']}")]
    for name, layer in m["layers"].items():
        share = f"{layer['dropped_fraction']:.4f} / {layer['load_max']:.2f}x mean"
        rows.append((f"  {name} dropped / max load", share))
        rows.append((f"  {name} rows per expert", ", ".join(f"{n:,}" for n in layer["tokens_per_expert"])))
    return rows


def bounds_rows(b: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Summary-table rows of ``picasso.bounds_check`` "warn" / "clamp": the out-of-range ids replaced, by table.

    Example::

        bounds_rows({"mode": "warn", "out_of_range_ids": 3, "by_table": {"emb0": 3}})
        # [("picasso ids out of range (warn, rank 0)", "3 -> row 0 (emb0: 3)")]
    """
    if not b:
        return []
    target = "row 0" if b["mode"] == "warn" else "clamped"
    tables = ", ".join(f"{t}: {n:,}" for t, n in sorted(b["by_table"].items()))
    return [(f"picasso ids out of range ({b['mode']}, rank 0)",
             f"{b['out_of_range_ids']:,} -> {target}" + (f" ({tables})" if tables else ""))]


def gba_rows(g: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Summary-table rows of a GBA job: mode, switches and their cost, staleness, per-worker samples/s."""
    if not g:
        return []
    rows = [("gba mode (end) / steps per mode", f"{g['mode']} / {g['steps_per_mode']}"),
            ("gba switches", f"{len(g['switches'])} ({g['switch_seconds']:.3f} s, {g['switch_bytes'] / 1e6:.2f} MB)")]
    rows += [(f"  job step {e['step']}", f"{e['src']} -> {e['dst']}: {e['reason']}") for e in g["switches"]]
    if g["staleness_histogram"]:
        rows.append(("gba staleness (tau: grads)", ", ".join(f"{t}: {n}" for t, n in g["staleness_histogram"].items())))
    if g["gradients"]:
        rows.append(("gba gradients", ", ".join(f"{k} {v}" for k, v in g["gradients"].items())))
    if g.get("clipped_updates"):
        rows.append(("gba updates clipped (servers)", f"{g['clipped_updates']}"))
    if g.get("lost_workers") or g.get("rejoined_workers"):
        rows.append(("gba workers lost / rejoined", f"{g.get('lost_workers', [])} / {g.get('rejoined_workers', [])}"))
    if g.get("row_cache"):  # this worker's cache in front of the servers (gba_engine/row_cache.py)
        c = g["row_cache"]
        rows.append(("gba row cache hit rate / refreshes", f"{c['hit_rate']:.4f} / {c['refreshes']:,} "
                                                          f"(max served age {c['max_served_age']})"))
        rows.append(("gba row cache MB saved", f"{c['row_bytes_saved'] / 1e6:.2f}"))
    if g.get("ps_bytes"):
        rows.append(("gba MB pulled / pushed (this worker)",
                     f"{g['ps_bytes']['pulled'] / 1e6:.2f} / {g['ps_bytes']['pushed'] / 1e6:.2f}"))
    rows.append(("samples/s per worker", ", ".join(f"{float(v):,.0f}" for v in g["samples_per_s"].values())))
    return rows


def epoch_rows(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Summary-table rows of the per-epoch evaluations (entries with an ``epoch``): AUC and log loss of each.

    Example::

        epoch_rows([{"step": 10, "epoch": 0, "auc": 0.71, "log_loss": 0.52}])
        # [("  epoch 0 (step 10)", "AUC 0.7100, log loss 0.5200")]
    """
    return [(f"  epoch {h['epoch']} (step {h['step']})", f"AUC {h['auc']:.4f}, log loss {h['log_loss']:.4f}")
            for h in history if "epoch" in h]


def best_rows(b: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Summary-table rows of ``--early-stop-metric``: the best evaluation, its checkpoint, and the early stop."""
    if not b or "step" not in b:
        return []
    where = f"step {b['step']}" + (f", epoch {b['epoch']}" if "epoch" in b else "")
    rows = [(f"best by {b['metric']}", f"{where}: AUC {b['auc']:.4f}, log loss {b['log_loss']:.4f}"),
            ("best checkpoint", str(b.get("checkpoint", "")))]
    if b.get("early_stopped"):
        rows.append(("early stop", f"at step {b['stopped_at_step']} (patience {b['patience']})"))
    return rows


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The final summary table's ``(name, value)`` rows of a summary.json mapping."""
    rows = [
        ("ranks", f"{s['world_size']} ({s['launcher']})"),
        ("steps / samples", f"{s['steps']} / {s['samples']:,}"),
        ("samples/s (this run)", f"{s['samples_per_s']:,.0f}"),
        ("eval samples", f"{int(s['eval_samples']):,}"),
        ("AUC", f"{s['auc']:.4f}"),
    ]
    if "bayes_auc" in s:
        gap = s["bayes_auc"] - s["auc"]
        rows.append(("best reachable AUC", f"{s['bayes_auc']:.4f}  (planted teacher; gap {gap:.4f})"))
    teacher = f"  (teacher {s['bayes_log_loss']:.4f})" if "bayes_log_loss" in s else ""
    rows.append(("log loss", f"{s['log_loss']:.4f}" + teacher))
    epochs = epoch_rows(s.get("eval_history") or [])
    rows += [("per-epoch held-out", f"{len(epochs)} epoch(s)")] + epochs if epochs else []
    rows += best_rows(s.get("best"))
    if "cache_hit_rate" in s.get("picasso", {}):
        rows.append(("picasso cache hit rate", f"{s['picasso']['cache_hit_rate']:.4f}"))
    rows += bounds_rows((s.get("picasso") or {}).get("bounds_check"))
    rows += moe_rows(s.get("moe"))
    rows += gba_rows(s.get("gba"))
    rows += [("checkpoint", s["checkpoint"]), ("wandb", f"{s['wandb_dir']} ({s['wandb_mode']})")]
    return rows
