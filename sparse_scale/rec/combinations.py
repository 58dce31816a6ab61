"""Which plugin blocks and flags a recommender job may combine: every rule in one place, each with its reason.

Example::

    check_combinations(RecJobConfig(config="ds_configs/demo_cpu.json", server_tables=True))
    # CombinationError: ds_configs/demo_cpu.json: --server-tables needs a gba block (the tables live on ...)
"""
from __future__ import annotations

from sparse_scale.block_rules import BLOCK_RULES, Rule
from sparse_scale.rec.config import RecJobConfig, RecJobError


class CombinationError(RecJobError):
    """Options that cannot be used together; ``rule`` names the refusal, the message gives its reason."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def _gba(job: RecJobConfig):
    return job.loaded.blocks.get("gba")


def _picasso(job: RecJobConfig):
    return job.loaded.blocks.get("picasso")


DEFAULT_EMBEDDING_DIM = RecJobConfig.__dataclass_fields__["embedding_dim"].default


def _from_block_rule(rule: Rule) -> Rule:
    """A block-level rule (``sparse_scale.block_rules``) as a rule of the job, naming the job's file."""
    return Rule(rule.name, lambda j: rule.applies(dict(j.loaded.blocks)),
                lambda j: f"{j.config}: {rule.reason(dict(j.loaded.blocks))}")


RULES: tuple[Rule, ...] = tuple(_from_block_rule(r) for r in BLOCK_RULES) + (
    Rule("ps-link-without-gba",
         lambda j: _gba(j) is None and (j.ps_link_latency_ms > 0 or j.ps_link_mbit > 0),
         lambda j: f"{j.config}: --ps-link-latency-ms / --ps-link-mbit model the link to the parameter servers, "
                   "which only a gba block has"),
    Rule("eval-every+async",
         lambda j: _gba(j) is not None and _gba(j).mode != "sync" and j.eval_every > 0,
         lambda j: f"{j.config}: --eval-every with gba.mode={_gba(j).mode!r}: workers run at their own pace in gba "
                   "mode and evaluation is a collective over them; evaluate at the end (or score the --save-every "
                   "checkpoints)"),
    Rule("moe-model-in-rec",
         lambda j: "moe_model" in j.loaded.blocks,
         lambda j: f"{j.config}: a moe_model block shapes the MoE language model (launch/train_moe_lm.py); a rec "
                   "job's MoE tower is --model's MLP with the moe_proto block's experts: remove the moe_model block"),
    Rule("embedding-dim+picasso",
         lambda j: (_picasso(j) is not None and j.embedding_dim != DEFAULT_EMBEDDING_DIM
                    and j.embedding_dim != _picasso(j).embedding_dim),
         lambda j: f"{j.config}: --embedding-dim {j.embedding_dim} with a picasso block: the packed tables take "
                   f"picasso.embedding_dim ({_picasso(j).embedding_dim}); set the width there and drop the flag"),
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
