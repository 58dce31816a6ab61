"""Which plugin blocks and flags a recommender job may combine: every rule in one place, each with its reason.

Example::

    check_combinations(RecJobConfig(config="ds_configs/demo_cpu.json", server_tables=True))
    # CombinationError: ds_configs/demo_cpu.json: --server-tables needs a gba block (the tables live on ...)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from sparse_scale.rec.config import RecJobConfig, RecJobError


class CombinationError(RecJobError):
    """Options that cannot be used together; ``rule`` names the refusal, the message gives its reason."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


@dataclasses.dataclass(frozen=True)
class Rule:
    """One refused combination: ``applies(job)`` says whether ``job`` hits it, ``reason(job)`` why it is refused."""

    name: str
    applies: Callable[[RecJobConfig], bool]
    reason: Callable[[RecJobConfig], str]


def _gba(job: RecJobConfig):
    return job.loaded.blocks.get("gba")


RULES: tuple[Rule, ...] = (
    Rule("gba+picasso",
         lambda j: _gba(j) is not None and "picasso" in j.loaded.blocks,
         lambda j: f"{j.config}: the gba and picasso blocks cannot be combined yet (the parameter servers hold "
                   "the dense parameters; packed tables update on the workers)"),
    Rule("eval-every+async",
         lambda j: _gba(j) is not None and _gba(j).mode != "sync" and j.eval_every > 0,
         lambda j: f"{j.config}: --eval-every with gba.mode={_gba(j).mode!r}: workers run at their own pace in gba "
                   "mode and evaluation is a collective over them; evaluate at the end (or score the --save-every "
                   "checkpoints)"),
    Rule("rejoin+resume",
         lambda j: _gba(j) is not None and j.rejoin_as is not None and j.resume,
         lambda j: "--rejoin-as continues the running job's state; it cannot --resume a checkpoint"),
    Rule("rejoin+sync",
         lambda j: _gba(j) is not None and j.rejoin_as is not None and _gba(j).mode == "sync",
         lambda j: f"{j.config}: --rejoin-as needs gba.mode gba or auto: a sync job keeps DeepSpeed's fixed "
                   "all-reduce group, which a restarted process cannot join"),
    Rule("rejoin-without-gba",
         lambda j: _gba(j) is None and j.rejoin_as is not None,
         lambda j: f"{j.config}: --rejoin-as needs a gba block (a restarted worker joins its servers)"),
    Rule("server-tables-without-gba",
         lambda j: _gba(j) is None and j.server_tables,
         lambda j: f"{j.config}: --server-tables needs a gba block (the tables live on its parameter servers)"),
    Rule("files-without-files",
         lambda j: j.data != "synthetic" and not (j.train_files and j.eval_files),
         lambda j: f"--data {j.data} needs --train-files and --eval-files"),
)


def refusals(job: RecJobConfig) -> list[CombinationError]:
    """Every rule ``job`` breaks, in the order of :data:`RULES` (empty: the job may run)."""
    return [CombinationError(r.name, r.reason(job)) for r in RULES if r.applies(job)]


def check_combinations(job: RecJobConfig) -> None:
    """Raise the first :class:`CombinationError` of ``job``, if any."""
    found = refusals(job)
    if found:
        raise found[0]
