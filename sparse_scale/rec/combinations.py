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


def _picasso(job: RecJobConfig):
    return job.loaded.blocks.get("picasso")


def _moe(job: RecJobConfig):
    return job.loaded.blocks.get("moe_proto")


DEFAULT_EMBEDDING_DIM = RecJobConfig.__dataclass_fields__["embedding_dim"].default
DROPLESS_UNUSED = ("capacity_factor", "eval_capacity_factor", "min_capacity", "drop_policy")


def _dropless_unused(job: RecJobConfig) -> list[str]:
    """The moe_proto keys set in the file that a dropless tower never reads (no capacity, nothing dropped)."""
    moe = _moe(job)
    if moe is None or not moe.dropless:
        return []
    return [k for k in DROPLESS_UNUSED if k in moe.model_fields_set]


def _bounds_where(job: RecJobConfig) -> str | None:
    """Why the job's picasso.bounds_check "warn" / "clamp" cannot apply (None: it can, or it is "fatal")."""
    p = _picasso(job)
    if p is None or p.bounds_check == "fatal":
        return None
    if _gba(job) is not None:
        return "a gba block (the tables live on the parameter servers, which check ids and stop at a bad one)"
    if p.cache is not None:
        return "picasso.cache (the cache maps ids to its slots on its own path, which stops at a bad id)"
    if p.sharding != "data_parallel":
        return f'picasso.sharding "{p.sharding}" (row-wise tables route ids to their owners and stop at a bad one)'
    return None


RULES: tuple[Rule, ...] = (
    Rule("gba+picasso-row-wise",
         lambda j: _gba(j) is not None and _picasso(j) is not None and _picasso(j).sharding == "row_wise",
         lambda j: f"{j.config}: picasso.sharding 'row_wise' with a gba block: the packed tables' rows are "
                   "spread over the parameter servers by id already; use sharding 'data_parallel' (the default)"),
    Rule("gba+picasso-cache",
         lambda j: (_gba(j) is not None and _picasso(j) is not None and _picasso(j).cache is not None
                    and _picasso(j).cache.store != "ps"),
         lambda j: f"{j.config}: picasso.cache.store={_picasso(j).cache.store!r} with a gba block: that store keeps "
                   "trained rows on the worker, while with gba the parameter servers own the rows and their "
                   "optimizer; use store 'ps' (a read cache in front of the servers, gba_engine/row_cache.py)"),
    Rule("ps-link-without-gba",
         lambda j: _gba(j) is None and (j.ps_link_latency_ms > 0 or j.ps_link_mbit > 0),
         lambda j: f"{j.config}: --ps-link-latency-ms / --ps-link-mbit model the link to the parameter servers, "
                   "which only a gba block has"),
    Rule("gba+picasso-interleave",
         lambda j: _gba(j) is not None and _picasso(j) is not None and _picasso(j).interleave.micro_batches > 1,
         lambda j: f"{j.config}: picasso.interleave.micro_batches > 1 with a gba block: interleaving overlaps "
                   "the fused sparse backward of worker-held tables, while the servers' tables take their update "
                   "at the step boundary from one push; set micro_batches to 1"),
    Rule("gba+picasso-prefetch",
         lambda j: _gba(j) is not None and _picasso(j) is not None and _picasso(j).interleave.prefetch_batches > 0,
         lambda j: f"{j.config}: picasso.interleave.prefetch_batches > 0 with a gba block: a gba job hands its "
                   "batches out by number (claim_batches), so there is no rank stream to read ahead; set it to 0"),
    Rule("eval-every+async",
         lambda j: _gba(j) is not None and _gba(j).mode != "sync" and j.eval_every > 0,
         lambda j: f"{j.config}: --eval-every with gba.mode={_gba(j).mode!r}: workers run at their own pace in gba "
                   "mode and evaluation is a collective over them; evaluate at the end (or score the --save-every "
                   "checkpoints)"),
    Rule("gba+moe-expert-parallel",
         lambda j: _gba(j) is not None and _moe(j) is not None and _moe(j).ep_size > 1,
         lambda j: f"{j.config}: moe_proto.ep_size={_moe(j).ep_size} with a gba block: expert parallelism sends "
                   "every sample's rows to their experts' owners by all-to-all, which needs the workers in lockstep, "
                   "while gba workers run at their own pace (and DeepSpeed's expert groups would span the parameter "
                   "servers); use ep_size 1: with a gba block every worker holds every expert, trained through the "
                   "servers like the other dense parameters"),
    Rule("moe-model-in-rec",
         lambda j: "moe_model" in j.loaded.blocks,
         lambda j: f"{j.config}: a moe_model block shapes the MoE language model (launch/train_moe_lm.py); a rec "
                   "job's MoE tower is --model's MLP with the moe_proto block's experts: remove the moe_model block"),
    Rule("moe-dropless-unused-keys",
         lambda j: bool(_dropless_unused(j)),
         lambda j: f"{j.config}: moe_proto.dropless is true, so the tower keeps every route and never reads "
                   f"moe_proto.{', moe_proto.'.join(_dropless_unused(j))}; remove them (or set dropless false)"),
    Rule("embedding-dim+picasso",
         lambda j: (_picasso(j) is not None and j.embedding_dim != DEFAULT_EMBEDDING_DIM
                    and j.embedding_dim != _picasso(j).embedding_dim),
         lambda j: f"{j.config}: --embedding-dim {j.embedding_dim} with a picasso block: the packed tables take "
                   f"picasso.embedding_dim ({_picasso(j).embedding_dim}); set the width there and drop the flag"),
    Rule("bounds-check-unsupported",
         lambda j: _bounds_where(j) is not None,
         lambda j: f"{j.config}: picasso.bounds_check \"{_picasso(j).bounds_check}\" with {_bounds_where(j)}: "
                   "out-of-range ids are replaced and counted in the packed data-parallel lookup only; use "
                   "bounds_check \"fatal\""),
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
