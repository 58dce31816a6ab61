"""What the entry scripts share: wandb set-up and the summary table for people."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence


def setup_wandb_env(out: Path) -> str:
    """Offline wandb unless the user has a key or chose a mode; returns the mode."""
    os.environ.setdefault("WANDB_DIR", str(out))
    if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY"):
        os.environ["WANDB_MODE"] = "offline"
    return os.environ.get("WANDB_MODE", "online")


def wandb_dir(rank: int) -> str | None:
    """The local folder of this job's wandb run (rank 0 only; DeepSpeed's monitor starts it there)."""
    if rank != 0:
        return None
    import wandb

    return wandb.run.dir if wandb.run is not None else None


def finish_wandb(rank: int) -> None:
    """Close the wandb run so an offline run is complete on disk."""
    if rank == 0:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def print_table(rows: Sequence[tuple[str, object]]) -> None:
    """The final summary for people: one ``name  value`` line per row between two rules."""
    width = max(len(k) for k, _ in rows)
    print("\n" + "-" * 72)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * 72, flush=True)
