"""Plan a (trillion-parameter) MoE LM config onto GPUs before renting them: counts, memory, traffic.

    sparse-plan ds_configs/m6t_1t.json --gpus 480 --gpu-mem 32      # or: python -m sparse_scale.lm.plan ...

(The command line and the config-file reading live in the job layer, :mod:`sparse_scale.lm.plan`;
this module plans validated blocks.)

The model is built on the meta device (shapes only, no memory), so parameter counts are
those of the real :class:`~moe_proto.models.MoETransformerLM`. Per GPU, with ``W`` GPUs,
expert-parallel size ``ep`` and expert data parallelism ``edp = W / ep``:

* parameters: experts ``E_params / ep`` (each EP rank holds ``E/ep`` experts of every MoE
  layer), dense parts (attention, norms, routers, embeddings) replicated;
* ZeRO partitions over data parallelism: stage 1 the optimizer state, stage 2 also the
  gradients, stage 3 also the parameters; dense parts over ``W`` ranks, experts over ``edp``
  (under stage 3 as DeepSpeed's AutoEP placement does for :class:`moe_proto.zero3.ZeRO3MoE`;
  rows of stage 3 carry :data:`ZERO3_NOTE`);
* bytes per parameter: params and grads 2 (fp16/bf16) or 4 (fp32); optimizer: Adam keeps
  an fp32 master copy (mixed precision only) + 2 fp32 moments (12 or 8 B); Adafactor
  (beta1=None) an fp32 master copy (mixed precision only) + factored second moments: one
  fp32 row and column vector per matrix (per expert for stacked experts), a full fp32
  vector for 1-D parameters;
* offload: ``"optimizer"`` moves master weights and moments to CPU (ZeRO-Offload),
  ``"optimizer_and_params"`` also the 16-bit parameters (ZeRO-Infinity, stage 3; the GPU keeps
  the block being computed);
* activations, per micro-batch of ``b`` sequences of ``s`` tokens, ``e`` bytes per element,
  width ``h``, dense FFN ``f``, expert FFN ``f_e``, ``E`` experts, ``r`` routes per token,
  capacity factor ``cf`` (1 when dropless), routed rows ``R = cf * r * b * s``:
  attention ``6*e*b*s*h`` (LN input, QKV input, Q, K, V, attention output; fused SDPA keeps
  no ``s x s`` scores), dense FFN ``e*b*s*(2h + 2f)`` (+``f`` for SwiGLU), MoE FFN
  ``e*b*s*2h + 8*b*s*E + e*R*(2h + 2f_e)`` (router input, fp32 logits and probs, gathered rows,
  expert hidden pre/post activation, expert output), logits ``8*b*s*V``. With activation
  checkpointing each block keeps only its input ``e*b*s*h`` plus one block's full set;
* all-to-all per step and rank: each MoE layer exchanges ``R*h*e`` bytes (the share
  ``(ep-1)/ep`` leaves the rank) twice forward (dispatch, combine) and twice backward
  (three times each with checkpointing's recompute), per micro-batch;
* fits when params + grads + optimizer + activations + ``reserve`` (CUDA context, NCCL
  buffers, allocator fragmentation; 2 GB by default) <= ``--gpu-mem``.

Not counted: temporary fp32 gradient partitions during the optimizer step, ZeRO's
communication buckets, pipeline or tensor parallelism (not used by these configs).

Example::

    plan = plan_blocks(ds, model_cfg, moe_cfg, gpus=480, gpu_mem_gb=32)   # blocks of ds_configs/m6t_1t.json
    plan.base.fits, plan.counts.total
    print(format_plan(plan))
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .layer import MoEBase
from .models.config import MoEModelConfig
from .models.transformer import MoETransformerArgs, MoETransformerLM

logger = logging.getLogger(__name__)

GB = 1e9
DEFAULT_RESERVE_GB = 2.0
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
OFFLOADS = ("none", "optimizer", "optimizer_and_params")
OPTIMIZERS = ("adam", "adafactor")
# What a ZeRO-3 row needs (docs/moe.md "ZeRO-3"): the layer class DeepSpeed 0.19.8 accepts there.
ZERO3_NOTE = ("ZeRO-3 needs the MoE layers built with zero_stage=3 (moe_proto.zero3.ZeRO3MoE, DeepSpeed's AutoEP "
              "layer class; tested without offload); the LM job builds them under a stage-3 config")


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the whole model (all experts on one imaginary device)."""

    total: int
    expert: int  # stacked expert weights of all MoE layers
    dense: int  # everything else: embeddings, attention, norms, routers, dense FFNs
    adafactor_state_expert: int  # fp32 elements of factored second moments for the experts
    adafactor_state_dense: int
    largest_block: int  # params of the largest transformer block (ZeRO-3 working set)
    largest_block_expert: int


@dataclass(frozen=True)
class Choices:
    """The memory choices a plan is made for."""

    zero_stage: int
    precision: str
    optimizer: str
    offload: str
    activation_checkpointing: bool

    def label(self) -> str:
        ckpt = "ckpt" if self.activation_checkpointing else "no-ckpt"
        return f"ZeRO-{self.zero_stage} {self.precision} {self.optimizer} offload={self.offload} {ckpt}"

    def invalid_reason(self) -> Optional[str]:
        if self.offload == "optimizer_and_params" and self.zero_stage != 3:
            return "parameter offload needs ZeRO-3"
        if self.offload == "optimizer" and self.zero_stage == 0:
            return "optimizer offload needs ZeRO 1-3"
        return None


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU (and per rank on the CPU) for one set of choices."""

    choices: Choices
    params: float
    grads: float
    optimizer: float
    activations: float
    reserve: float
    cpu: float  # offloaded bytes per rank in host memory
    gpu_mem: float
    notes: Tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.choices.invalid_reason() is None and self.total <= self.gpu_mem


@dataclass(frozen=True)
class Plan:
    """A config's plan: counts, traffic, its own choices and the alternatives."""

    source: str
    args: MoETransformerArgs
    gpus: int
    gpu_mem_gb: float
    micro_batch: int
    grad_accum: int
    counts: ParamCounts
    params_per_rank: float  # stored on one GPU before ZeRO-3 partitioning
    expert_params_per_rank: float
    alltoall_bytes_per_step: float  # sent by one rank to other ranks per optimizer step
    base: MemoryPlan
    alternatives: List[MemoryPlan]
    notes: Tuple[str, ...] = ()


def build_meta_model(args: MoETransformerArgs) -> MoETransformerLM:
    """The model with meta tensors (no memory), at ep_size 1 so that it holds every expert."""
    with torch.device("meta"):
        return MoETransformerLM(args.replace(ep_size=1))


def _adafactor_elements(param: nn.Parameter, stacked: bool) -> int:
    """fp32 elements of Adafactor's factored second moment for one parameter."""
    shape = tuple(param.shape)
    if len(shape) < 2:
        return param.numel()
    lead = math.prod(shape[:-2]) if stacked or len(shape) > 2 else 1
    return lead * (shape[-2] + shape[-1])


def count_parameters(model: nn.Module) -> ParamCounts:
    """Total, expert and dense parameter counts (and Adafactor state sizes) of a (meta) model.

    Example::

        counts = count_parameters(build_meta_model(args))
    """
    expert_ids = {id(p) for m in model.modules() if isinstance(m, MoEBase) for p in m.experts.parameters()}
    total = expert = ada_e = ada_d = 0
    for p in model.parameters():
        n = p.numel()
        total += n
        if id(p) in expert_ids:
            expert += n
            ada_e += _adafactor_elements(p, stacked=True)
        else:
            ada_d += _adafactor_elements(p, stacked=False)
    largest, largest_expert = 0, 0
    for block in getattr(model, "blocks", []):
        n = sum(p.numel() for p in block.parameters())
        if n > largest:
            largest = n
            largest_expert = sum(p.numel() for p in block.parameters() if id(p) in expert_ids)
    return ParamCounts(total, expert, total - expert, ada_e, ada_d, largest, largest_expert)


def routed_rows(args: MoETransformerArgs, tokens: int) -> float:
    """Rows one MoE layer computes for ``tokens`` tokens (capacity-padded upper bound)."""
    cf = 1.0 if args.dropless else args.capacity_factor
    return cf * args.num_prototypes * args.top_k * tokens


def activation_bytes(args: MoETransformerArgs, micro_batch: int, elem: int, checkpointing: bool) -> float:
    """Activation estimate for one micro-batch on one GPU (formula in the module docstring)."""
    bs, h = micro_batch * args.max_seq_len, args.d_model
    gated = args.activation == "swiglu"
    attn = 6 * elem * bs * h
    dense_ffn = elem * bs * (2 * h + 2 * args.ffn_hidden_size + (args.ffn_hidden_size if gated else 0))
    rows = routed_rows(args, bs)
    f_e = args.expert_ffn
    moe_ffn = elem * bs * 2 * h + 8 * bs * args.num_experts + elem * rows * (2 * h + 2 * f_e + (f_e if gated else 0))
    per_block = [attn + (moe_ffn if args.is_moe_layer(i) else dense_ffn) for i in range(args.num_layers)]
    logits = 8 * bs * args.vocab_size
    if checkpointing:
        return args.num_layers * elem * bs * h + max(per_block) + logits
    return sum(per_block) + logits


def alltoall_bytes(args: MoETransformerArgs, micro_batch: int, grad_accum: int, elem: int, ep_size: int,
                   checkpointing: bool) -> float:
    """Bytes one rank sends to other ranks in all-to-alls per optimizer step."""
    if ep_size == 1 or args.num_experts == 0:
        return 0.0
    rows = routed_rows(args, micro_batch * args.max_seq_len)
    per_exchange = rows * args.d_model * elem * (ep_size - 1) / ep_size
    exchanges = 6 if checkpointing else 4
    return per_exchange * exchanges * args.num_moe_layers * grad_accum


def plan_memory(counts: ParamCounts, args: MoETransformerArgs, choices: Choices, gpus: int, ep_size: int,
                micro_batch: int, gpu_mem_gb: float, reserve_gb: float = DEFAULT_RESERVE_GB) -> MemoryPlan:
    """Bytes per GPU for ``choices`` (see the module docstring for every term).

    Example::

        plan_memory(counts, args, Choices(2, "fp16", "adafactor", "none", True), gpus=480, ep_size=480,
                    micro_batch=4, gpu_mem_gb=32)
    """
    if gpus % ep_size:
        raise ValueError(f"{gpus} GPUs are not a multiple of ep_size={ep_size}")
    dp, edp = gpus, gpus // ep_size
    p = PRECISION_BYTES[choices.precision]
    mixed = choices.precision != "fp32"
    expert_local = counts.expert / ep_size
    dense = counts.dense
    # Elements each rank keeps of params, grads and optimizer state after ZeRO partitioning.
    par_div = (dp, edp) if choices.zero_stage >= 3 else (1, 1)
    grad_div = (dp, edp) if choices.zero_stage >= 2 else (1, 1)
    opt_div = (dp, edp) if choices.zero_stage >= 1 else (1, 1)
    params = p * (dense / par_div[0] + expert_local / par_div[1])
    grads = p * (dense / grad_div[0] + expert_local / grad_div[1])
    master = 4 if mixed else 0
    if choices.optimizer == "adam":
        opt_dense, opt_expert = (master + 8) * dense, (master + 8) * expert_local
    else:
        opt_dense = master * dense + 4 * counts.adafactor_state_dense
        opt_expert = master * expert_local + 4 * counts.adafactor_state_expert / ep_size
    optimizer = opt_dense / opt_div[0] + opt_expert / opt_div[1]
    cpu = 0.0
    notes: List[str] = []
    if choices.offload in ("optimizer", "optimizer_and_params"):
        cpu += optimizer
        optimizer = 0.0
    if choices.offload == "optimizer_and_params":
        cpu += params
        # The block being computed is gathered on the GPU (its experts only the local ones).
        block = counts.largest_block - counts.largest_block_expert + counts.largest_block_expert / ep_size
        params = p * block
    if choices.zero_stage == 3 and args.num_experts:
        notes.append(ZERO3_NOTE)
    reason = choices.invalid_reason()
    if reason:
        notes.append(reason)
    act = activation_bytes(args, micro_batch, p, choices.activation_checkpointing)
    return MemoryPlan(choices, params, grads, optimizer, act, reserve_gb * GB, cpu, gpu_mem_gb * GB, tuple(notes))


def _ds_choices(ds: Mapping[str, Any], model_cfg: MoEModelConfig) -> Tuple[Choices, List[str]]:
    """The config's choices; notes where the DeepSpeed part says something else."""
    zero = ds.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    notes = []
    ds_precision = "bf16" if (ds.get("bf16") or {}).get("enabled") else "fp16" if (ds.get("fp16") or {}).get(
        "enabled") else "fp32"
    if ds_precision != model_cfg.precision:
        notes.append(f"moe_model.precision={model_cfg.precision} but the DeepSpeed section enables {ds_precision}")
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    off_par = (zero.get("offload_param") or {}).get("device", "none") not in ("none", None)
    ds_offload = "optimizer_and_params" if off_par else "optimizer" if off_opt else "none"
    if ds_offload != model_cfg.offload:
        notes.append(f"moe_model.offload={model_cfg.offload} but zero_optimization offloads {ds_offload}")
    return Choices(stage, model_cfg.precision, model_cfg.optimizer, model_cfg.offload,
                   model_cfg.activation_checkpointing), notes


def plan_blocks(ds: Mapping[str, Any], model_cfg: MoEModelConfig, moe_cfg: Optional[Any], gpus: int,
                gpu_mem_gb: float, reserve_gb: float = DEFAULT_RESERVE_GB, source: str = "<config>") -> Plan:
    """Plan a config's validated blocks on ``gpus`` GPUs of ``gpu_mem_gb`` GB each.

    ``ds`` is the DeepSpeed part, ``model_cfg`` the ``moe_model`` block, ``moe_cfg`` the
    ``moe_proto`` block (None: dense); ``source`` names the config in the plan and errors.
    Reading a config file is the job layer's (``sparse_scale.lm.plan.plan_config``).

    Example::

        plan = plan_blocks(job.ds, job.blocks["moe_model"], job.blocks.get("moe_proto"), gpus=480, gpu_mem_gb=32)
    """
    args = MoETransformerArgs.from_configs(model_cfg, moe_cfg)
    ep_size = moe_cfg.ep_size if moe_cfg is not None else 1
    if gpus % ep_size:
        raise ValueError(f"{source}: ep_size={ep_size} does not divide --gpus {gpus}")
    micro_batch = int(ds.get("train_micro_batch_size_per_gpu", 1))
    grad_accum = int(ds.get("gradient_accumulation_steps", 1))
    counts = count_parameters(build_meta_model(args))
    base_choices, notes = _ds_choices(ds, model_cfg)
    base = plan_memory(counts, args, base_choices, gpus, ep_size, micro_batch, gpu_mem_gb, reserve_gb)
    alternatives = []
    precisions = [base_choices.precision] + [x for x in ("fp32",) if x != base_choices.precision]
    for stage, opt, off, prec in itertools.product(range(4), OPTIMIZERS, OFFLOADS, precisions):
        c = dataclasses.replace(base_choices, zero_stage=stage, optimizer=opt, offload=off, precision=prec)
        if c != base_choices and c.invalid_reason() is None:
            alternatives.append(plan_memory(counts, args, c, gpus, ep_size, micro_batch, gpu_mem_gb, reserve_gb))
    alternatives.sort(key=lambda m: (m.choices.precision != base_choices.precision, m.total))
    a2a = alltoall_bytes(args, micro_batch, grad_accum, PRECISION_BYTES[base_choices.precision], ep_size,
                         base_choices.activation_checkpointing)
    return Plan(str(source), args, gpus, gpu_mem_gb, micro_batch, grad_accum, counts,
                counts.dense + counts.expert / ep_size, counts.expert / ep_size, a2a, base, alternatives,
                tuple(notes))


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _row(m: MemoryPlan) -> str:
    verdict = "fits" if m.fits else ("invalid" if m.choices.invalid_reason() else "DOES NOT FIT")
    note = f"  ({'; '.join(m.notes)})" if m.notes else ""
    return (f"{m.choices.label():<52} {m.params / GB:7.1f} {m.grads / GB:7.1f} {m.optimizer / GB:7.1f} "
            f"{m.activations / GB:7.2f} {m.total / GB:8.1f} {m.cpu / GB:8.1f}  {verdict}{note}")


def format_plan(plan: Plan) -> str:
    """A readable report: counts, the config's memory, traffic, and the alternatives that fit or not."""
    a, c = plan.args, plan.counts
    ep = a.ep_size
    lines = [
        f"plan for {plan.source} on {plan.gpus} GPUs x {plan.gpu_mem_gb:g} GB",
        f"model: {a.num_layers} layers ({a.num_moe_layers} MoE), d_model {a.d_model}, {a.num_heads} heads, "
        f"ffn {a.ffn_hidden_size}, expert ffn {a.expert_ffn}, seq {a.max_seq_len}, vocab {a.vocab_size}",
        f"experts: {a.num_experts} per MoE layer, {a.num_prototypes} prototype(s) x top-{a.top_k}, ep_size {ep}, "
        f"expert data parallel {plan.gpus // ep}",
        f"parameters: total {c.total:,} ({_fmt_count(c.total)}), experts {_fmt_count(c.expert)}, "
        f"dense {_fmt_count(c.dense)}",
        f"per rank (before ZeRO-3): {_fmt_count(plan.params_per_rank)} "
        f"(experts {_fmt_count(plan.expert_params_per_rank)} + dense {_fmt_count(c.dense)})",
        f"micro-batch {plan.micro_batch} x {a.max_seq_len} tokens, gradient accumulation {plan.grad_accum}",
        f"all-to-all per step and rank: {plan.alltoall_bytes_per_step / GB:.2f} GB sent to other ranks",
        "",
        f"{'choices (GB per GPU)':<52} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'total':>8} "
        f"{'CPU/rank':>8}",
        "config: " + _row(plan.base),
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    fit = [m for m in plan.alternatives if m.fits]
    no_fit = [m for m in plan.alternatives if not m.fits]
    lines += ["", f"alternatives that fit ({len(fit)}):"] + ["  " + _row(m) for m in fit]
    lines += ["", f"alternatives that do not fit ({len(no_fit)}):"] + ["  " + _row(m) for m in no_fit]
    lines += ["", f"verdict: the config's choices {'FIT' if plan.base.fits else 'DO NOT FIT'} in "
                  f"{plan.gpu_mem_gb:g} GB ({plan.base.total / GB:.1f} GB per GPU incl. "
                  f"{plan.base.reserve / GB:g} GB reserve)"]
    return "\n".join(lines)


if __name__ == "__main__":  # the old `python -m moe_proto.plan`: say where the command line went
    raise SystemExit("the planner's command line is `sparse-plan` (or `python -m sparse_scale.lm.plan`)")
