"""What one LM job run reports: the summary (``OUT/summary.json``) and its table for people.

    summary = run(job)
    Path("summary.json").write_text(summary.to_json())
    print_table(summary_rows(summary))
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class LMSummary:
    """The result of :func:`sparse_scale.lm.run`, field for field the keys of ``summary.json``."""

    world_size: int
    launcher: str
    steps: int
    tokens: int
    tokens_per_s: float  # tokens trained in this run (not before a resume) per second of training
    train_time_s: float
    params: int
    num_experts: int  # 0: dense model
    num_prototypes: int
    top_k: int
    train_files: int
    heldout_files: int
    eval_loss: float  # nats per token
    eval_bits_per_byte: float
    eval_tokens: float
    checkpoint: str
    wandb_mode: str
    wandb_dir: Optional[str]  # rank 0 only

    def as_dict(self) -> dict[str, Any]:
        """The summary as a plain dict, keys in ``summary.json`` order."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The text of ``summary.json``."""
        return json.dumps(self.as_dict(), indent=2)


def summary_rows(s: LMSummary) -> list[tuple[str, object]]:
    """The rows of the final table (``sparse_scale.reporting.print_table``).

    Example::

        print_table(summary_rows(summary))      # ranks, model, data, steps / tokens, tokens/s, ...
    """
    routing = "dense" if not s.num_experts else (
        f"{s.num_experts} experts, {s.num_prototypes} prototype(s) x top-{s.top_k}")
    return [
        ("ranks", f"{s.world_size} ({s.launcher})"),
        ("model", f"{s.params:,} params, {routing}"),
        ("data", f"{s.train_files} train / {s.heldout_files} held-out files"),
        ("steps / tokens", f"{s.steps} / {s.tokens:,}"),
        ("tokens/s (this run)", f"{s.tokens_per_s:,.0f}"),
        ("held-out tokens", f"{int(s.eval_tokens):,}"),
        ("held-out loss", f"{s.eval_loss:.4f} nats/token"),
        ("bits per byte", f"{s.eval_bits_per_byte:.4f}"),
        ("checkpoint", s.checkpoint),
        ("wandb", f"{s.wandb_dir} ({s.wandb_mode})"),
    ]
