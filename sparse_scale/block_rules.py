"""Which plugin blocks of one config file may be combined: every block-level refusal, each with its reason.

The rules read only the validated blocks, so ``sparse_scale.initialize`` (any user's script) and the
shipped jobs refuse the same files with the same words. Rules about a job's flags live with the job
(``sparse_scale.rec.combinations``).

Example::

    >>> from sparse_scale.config import parse_config
    >>> job = parse_config({"gba": {"mode": "auto"}, "picasso": {"sharding": "row_wise"}}, source="x.json")
    >>> [r.rule for r in block_refusals(job)]
    ['gba+picasso-row-wise']
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sparse_core.config_file import ConfigError


class BlockCombinationError(ConfigError):
    """Blocks of one config that cannot be used together; ``rule`` names the refusal, the message its reason."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


@dataclasses.dataclass(frozen=True)
class Rule:
    """One refused combination: ``applies(x)`` says whether ``x`` hits it, ``reason(x)`` why it is refused.

    Here ``x`` is a config's blocks by name; a job's own rules take the job (``sparse_scale.rec.combinations``).
    """

    name: str
    applies: Callable[[Any], bool]
    reason: Callable[[Any], str]


DROPLESS_UNUSED = ("capacity_factor", "eval_capacity_factor", "min_capacity", "drop_policy")


def dropless_unused(blocks: dict[str, Any]) -> list[str]:
    """The moe_proto keys set in the file that a dropless layer never reads (no capacity, nothing dropped)."""
    moe = blocks.get("moe_proto")
    if moe is None or not moe.dropless:
        return []
    return [k for k in DROPLESS_UNUSED if k in moe.model_fields_set]


def bounds_check_obstacle(blocks: dict[str, Any]) -> str | None:
    """Why picasso.bounds_check "warn" / "clamp" cannot apply (None: it can, or it is "fatal")."""
    p = blocks.get("picasso")
    if p is None or p.bounds_check == "fatal":
        return None
    if blocks.get("gba") is not None:
        return "a gba block (the tables live on the parameter servers, which check ids and stop at a bad one)"
    if p.cache is not None:
        return "picasso.cache (the cache maps ids to its slots on its own path, which stops at a bad id)"
    if p.table_placement != "data_parallel":
        return f'picasso.sharding "{p.sharding}" (row-wise tables route ids to their owners and stop at a bad one)'
    return None


def _both(blocks: dict[str, Any], a: str, b: str) -> bool:
    return blocks.get(a) is not None and blocks.get(b) is not None


BLOCK_RULES: tuple[Rule, ...] = (
    Rule("gba+picasso-row-wise",
              lambda b: _both(b, "gba", "picasso") and b["picasso"].sharding == "row_wise",
              lambda b: "picasso.sharding 'row_wise' with a gba block: the packed tables' rows are spread over the "
                        "parameter servers by id already; use sharding 'data_parallel' (the default)"),
    Rule("gba+picasso-cache",
              lambda b: _both(b, "gba", "picasso") and b["picasso"].cache is not None
              and b["picasso"].cache.store != "ps",
              lambda b: f"picasso.cache.store={b['picasso'].cache.store!r} with a gba block: that store keeps trained "
                        "rows on the worker, while with gba the parameter servers own the rows and their optimizer; "
                        "use store 'ps' (a read cache in front of the servers, gba_engine/row_cache.py)"),
    Rule("gba+picasso-interleave",
              lambda b: _both(b, "gba", "picasso") and b["picasso"].interleave.micro_batches > 1,
              lambda b: "picasso.interleave.micro_batches > 1 with a gba block: interleaving overlaps the fused "
                        "sparse backward of worker-held tables, while the servers' tables take their update at the "
                        "step boundary from one push; set micro_batches to 1"),
    Rule("gba+picasso-prefetch",
              lambda b: _both(b, "gba", "picasso") and b["picasso"].interleave.prefetch_batches > 0,
              lambda b: "picasso.interleave.prefetch_batches > 0 with a gba block: a gba job hands its batches out "
                        "by number (claim_batches), so there is no rank stream to read ahead; set it to 0"),
    Rule("gba+moe-expert-parallel",
              lambda b: _both(b, "gba", "moe_proto") and b["moe_proto"].ep_size > 1,
              lambda b: f"moe_proto.ep_size={b['moe_proto'].ep_size} with a gba block: expert parallelism sends every "
                        "sample's rows to their experts' owners by all-to-all, which needs the workers in lockstep, "
                        "while gba workers run at their own pace (and DeepSpeed's expert groups would span the "
                        "parameter servers); use ep_size 1: with a gba block every worker holds every expert, "
                        "trained through the servers like the other dense parameters"),
    Rule("gba+moe-global-load",
              lambda b: _both(b, "gba", "moe_proto") and (b["moe_proto"].expert_bias_update_rate > 0
                                                          or b["moe_proto"].aux_loss_scope == "global_batch"),
              lambda b: "moe_proto.expert_bias_update_rate > 0 and aux_loss_scope 'global_batch' sum expert loads "
                        "over the workers every step, and gba workers run asynchronously; with a gba block use "
                        "expert_bias_update_rate 0 and aux_loss_scope 'micro_batch'"),
    Rule("moe-dropless-unused-keys",
              lambda b: bool(dropless_unused(b)),
              lambda b: f"moe_proto.dropless is true, so the layers keep every route and never read "
                        f"moe_proto.{', moe_proto.'.join(dropless_unused(b))}; remove them (or set dropless false)"),
    Rule("bounds-check-unsupported",
              lambda b: bounds_check_obstacle(b) is not None,
              lambda b: f"picasso.bounds_check \"{b['picasso'].bounds_check}\" with {bounds_check_obstacle(b)}: "
                        "out-of-range ids are replaced and counted in the packed data-parallel lookup only; use "
                        "bounds_check \"fatal\""),
)


def block_refusals(job: Any) -> list[BlockCombinationError]:
    """Every block rule the loaded config ``job`` (a ``sparse_scale.config.JobConfig``) breaks, in order."""
    blocks = dict(job.blocks)
    return [BlockCombinationError(r.name, f"{job.source}: {r.reason(blocks)}") for r in BLOCK_RULES
            if r.applies(blocks)]


def check_blocks(job: Any) -> None:
    """Raise the first :class:`BlockCombinationError` of ``job``, if any."""
    found = block_refusals(job)
    if found:
        raise found[0]
