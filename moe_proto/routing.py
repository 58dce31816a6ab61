"""Routing: pure functions from router logits to one explicit routing record.

Every function here takes fp32 logits ``[S, E]`` (S tokens, E experts) and returns a
:class:`RoutingRecord`: which expert each route goes to, its combine weight, its row
inside that expert's buffer, whether it survived the capacity limit, per-expert
counts and the auxiliary losses. Nothing is modified in place, nothing dense of shape
``[S, E, C]`` is built, and randomness (RSample noise, random token selection) comes
in as explicit tensors so that the functions stay deterministic.

Two families:

* :func:`route` - the native router: top-k for any k and expert prototyping
  (``num_prototypes`` groups of consecutive experts, top-k' inside each group, the
  group outputs summed), capacity with a ``"probs"`` or ``"position"`` drop policy, or
  dropless.
* :func:`route_deepspeed_top1` / :func:`route_deepspeed_top2` - bit-for-bit the
  decisions of DeepSpeed 0.19.8 ``top1gating`` / ``top2gating`` with RTS and
  second-expert sampling off, for users who need the old numbers.

Example::

    logits = torch.randn(8, 4)
    rec = route(logits, top_k=1, num_prototypes=2, capacity_factor=1.0, min_capacity=0)
    rec.expert_index.shape   # torch.Size([8, 2]): one expert in {0,1} and one in {2,3}
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .balance import global_batch_aux_loss, sequence_aux_loss
from .ops import load_cpu_ops

DropPolicy = Literal["probs", "position"]
DROP_POLICIES: Tuple[str, ...] = ("probs", "position")
ScoreFunction = Literal["softmax", "sigmoid"]
SCORE_FUNCTIONS: Tuple[str, ...] = ("softmax", "sigmoid")
AuxLossScope = Literal["micro_batch", "sequence", "global_batch"]
AUX_LOSS_SCOPES: Tuple[str, ...] = ("micro_batch", "sequence", "global_batch")
# (routes per expert [E], used tokens) of this call -> the same counts over the whole global batch so far.
GlobalLoadFn = Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]
_SIGMOID_EPS = 1e-20  # keeps the sum of sigmoid scores away from 0 when they are normalised (DeepSeek-V3)


@dataclass(frozen=True)
class RoutingRecord:
    """The complete outcome of routing S tokens over E experts with K routes per token.

    Attributes:
        expert_index: ``[S, K]`` int64, global expert id of every route (dropped ones too).
        gate: ``[S, K]`` fp32 combine weight; 0 for dropped routes. Differentiable with
            respect to the logits.
        slot: ``[S, K]`` int64 row of the route inside its expert's buffer; kept routes of
            expert e fill rows ``0 .. tokens_per_expert[e]-1``; -1 for dropped routes.
        keep: ``[S, K]`` bool, True when the route is computed.
        tokens_per_expert: ``[E]`` int64 kept routes per expert (rows each expert computes).
        routed_per_expert: ``[E]`` int64 routes that chose each expert before capacity drops
            (DeepSpeed's ``exp_counts``).
        capacity: rows per expert, or None when dropless.
        aux_loss: scalar load-balancing loss (unscaled).
        z_loss: scalar router z-loss (unscaled).
    """

    expert_index: Tensor
    gate: Tensor
    slot: Tensor
    keep: Tensor
    tokens_per_expert: Tensor
    routed_per_expert: Tensor
    capacity: Optional[int]
    aux_loss: Tensor
    z_loss: Tensor

    @property
    def num_tokens(self) -> int:
        return self.expert_index.shape[0]

    @property
    def routes_per_token(self) -> int:
        return self.expert_index.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert.shape[0]

    def stats(self) -> "RoutingStats":
        """Detached summary for logging (no autograd graph is kept alive)."""
        routed = self.routed_per_expert.sum()
        dropped = (routed - self.tokens_per_expert.sum()).float()
        return RoutingStats(
            routed_per_expert=self.routed_per_expert.detach(),
            tokens_per_expert=self.tokens_per_expert.detach(),
            drop_rate=dropped / routed.clamp(min=1).float(),
            aux_loss=self.aux_loss.detach(),
            z_loss=self.z_loss.detach(),
            capacity=self.capacity,
        )


@dataclass(frozen=True)
class RoutingStats:
    """What a logger wants from one routing call: load, drops and the two losses."""

    routed_per_expert: Tensor
    tokens_per_expert: Tensor
    drop_rate: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    capacity: Optional[int]


def expert_capacity(num_tokens: int, num_experts: int, routes_per_token: int, capacity_factor: float,
                    min_capacity: int = 0) -> int:
    """Per-expert capacity ``C = max(ceil(cf * routes_per_token * S / E), min_capacity)``.

    ``cf`` is taken at its decimal value (``Fraction(str(cf))``) so that e.g. cf=1.1,
    S=10, E=1 gives 11 and not 12 from binary rounding.

    Example::

        expert_capacity(4096, 16, 1, 1.25)   # 320
    """
    exact = Fraction(str(capacity_factor)) * routes_per_token * num_tokens / num_experts
    return max(math.ceil(exact), min_capacity)


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2, generator: Optional[torch.Generator] = None) -> Tensor:
    """Return ``x * U(1-eps, 1+eps)`` elementwise (a new tensor; ``x`` is untouched).

    Used on the router input in training only (DeepSpeed's ``noisy_gate_policy='Jitter'``).

    Example::

        x_noisy = multiplicative_jitter(x, 1e-2)
    """
    if epsilon == 0:
        return x
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return x * (1.0 - epsilon + 2.0 * epsilon * noise)


def gumbel_noise(shape: Tuple[int, ...], device: torch.device, generator: Optional[torch.Generator] = None) -> Tensor:
    """Standard Gumbel samples, for ``route(selection_noise=...)``."""
    u = torch.rand(shape, generator=generator, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def router_z_loss(logits: Tensor, num_prototypes: int = 1, token_mask: Optional[Tensor] = None) -> Tensor:
    """Mean over tokens (and prototypes) of ``logsumexp(logits)^2`` (ST-MoE z-loss).

    With prototypes each group has its own softmax, so each group's logsumexp is
    penalised and the mean runs over tokens and groups.
    """
    s, e = logits.shape
    lse = torch.logsumexp(logits.reshape(s, num_prototypes, e // num_prototypes), dim=-1)
    return _masked_mean(lse.square().mean(dim=1), token_mask)


def route(
    logits: Tensor,
    *,
    top_k: int = 1,
    num_prototypes: int = 1,
    capacity_factor: Optional[float] = 1.0,
    min_capacity: int = 0,
    drop_policy: DropPolicy = "probs",
    normalize_topk: bool = True,
    used_token: Optional[Tensor] = None,
    rts_priority: Optional[Tensor] = None,
    selection_noise: Optional[Tensor] = None,
    noise_from_choice: int = 0,
    score_function: ScoreFunction = "softmax",
    expert_bias: Optional[Tensor] = None,
    normalize_routes: Optional[bool] = None,
    aux_loss_scope: AuxLossScope = "micro_batch",
    sequence_length: Optional[int] = None,
    global_load_fn: Optional[GlobalLoadFn] = None,
) -> RoutingRecord:
    """Route S tokens over E experts: top-k, expert prototyping, capacity or dropless.

    The E experts form ``P = num_prototypes`` groups of E/P consecutive experts. Each
    group softmaxes its slice of the logits and picks its ``top_k`` experts, so every
    token has ``K = P * top_k`` routes; P=1, top_k=1 is Switch top-1 and P=1, top_k=k is
    plain top-k. The layer output is the gate-weighted sum over routes.

    Gate weights: a group's selected probabilities are renormalised to sum to 1 when
    ``top_k > 1`` and ``normalize_topk`` (GShard/Mixtral style); with ``top_k == 1`` the
    raw softmax probability is used (Switch / M6-T; renormalising one gate would make it
    a constant 1 and cut the router's gradient). Gates are never renormalised across
    prototypes, nor after drops: a dropped route simply contributes 0.

    Capacity: ``C = max(ceil(capacity_factor * K * S / E), min_capacity)`` rows per
    expert (``capacity_factor=None`` is dropless). When an expert is over capacity,
    ``drop_policy="probs"`` keeps its routes with the highest (pre-normalisation) gate
    probability, ``"position"`` keeps the lowest token indices; ties go to the lower
    token index. ``rts_priority`` (``[S, K]``, e.g. ``torch.rand``) overrides the policy
    with random token selection; the layer passes it in training only.

    Aux loss: GShard/Switch ``E_g * sum_e f_e * p_e`` computed inside each prototype
    over its E_g = E/P experts (f_e = share of the group's routes choosing e before
    drops, p_e = mean router probability of e), then averaged over prototypes; P=1,
    top_k=1 is exactly DeepSpeed/Switch top-1's ``l_aux``. z-loss: see
    :func:`router_z_loss`. Both average over used tokens only.

    Scores: ``score_function="softmax"`` (above) or ``"sigmoid"`` (independent
    ``sigmoid(logit)`` per expert, DeepSeek-V3); with sigmoid the aux loss's ``p_e`` uses
    the scores divided by their sum within the prototype. ``normalize_routes`` overrides
    the renormalisation rule: True divides a prototype's selected gates by their sum for
    any top_k (top_k=1 softmax then gives weight 1), False never; None keeps
    ``top_k > 1 and normalize_topk``.

    Aux-loss-free balancing: ``expert_bias`` (``[E]``) is added to the scores for choosing
    experts only (top-k of ``score + bias``); gates, capacity priorities and the aux loss
    use the unbiased scores. Not combinable with ``selection_noise``.

    Aux loss scope: ``"micro_batch"`` as above over this call's S tokens; ``"sequence"``
    the same loss computed per sequence of ``sequence_length`` consecutive tokens
    (``f`` and ``p`` from that sequence's used tokens) and averaged over sequences that have
    used tokens (DeepSeek-V3's sequence-wise loss); ``"global_batch"`` takes ``f`` from
    ``global_load_fn(routed_per_expert, used_tokens)`` - the layer returns the counts summed
    over the micro-batches of the step so far and the data-parallel ranks (detached) - and
    ``p`` from this call's tokens (Megatron's global aux loss); without ``global_load_fn``
    it equals ``"micro_batch"``.

    Args:
        logits: ``[S, E]`` router logits (fp32 recommended).
        used_token: optional ``[S]`` mask; tokens with 0 are not routed and take no capacity.
        selection_noise: optional ``[S, E]`` noise added to the logits for *choosing*
            experts only (gates still come from the clean softmax); from choice
            ``noise_from_choice`` on (0 = RSample, 1 = DeepSpeed-style 2nd-expert sampling).

    Example::

        rec = route(torch.randn(16, 8), top_k=2, capacity_factor=1.25)
        rec.keep.sum() == rec.tokens_per_expert.sum()   # tensor(True)
    """
    s, e = _check_logits(logits)
    if num_prototypes < 1 or e % num_prototypes:
        raise ValueError(f"num_prototypes={num_prototypes} must be >= 1 and divide num_experts={e}")
    group = e // num_prototypes
    if not 1 <= top_k <= group:
        raise ValueError(f"top_k={top_k} must be in [1, experts per prototype={group}]")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r} must be one of {DROP_POLICIES}")
    if not 0 <= noise_from_choice < top_k and selection_noise is not None:
        raise ValueError(f"noise_from_choice={noise_from_choice} must be in [0, top_k={top_k})")
    routes = num_prototypes * top_k
    if rts_priority is not None and tuple(rts_priority.shape) != (s, routes):
        raise ValueError(f"rts_priority must be [tokens, routes] = [{s}, {routes}], got {tuple(rts_priority.shape)}")
    if selection_noise is not None and selection_noise.shape != logits.shape:
        raise ValueError(f"selection_noise must match logits {tuple(logits.shape)}, got {tuple(selection_noise.shape)}")
    _check_options(e, score_function, expert_bias, selection_noise, aux_loss_scope, sequence_length, s)
    token_mask = _token_mask(used_token, s, logits.device)

    logits_g = logits.reshape(s, num_prototypes, group)
    sigmoid = score_function == "sigmoid"
    probs_g = torch.sigmoid(logits_g) if sigmoid else _group_softmax(logits_g)
    if expert_bias is None:
        local, raw_gate = _select_topk(logits_g, probs_g, top_k, selection_noise, noise_from_choice)  # [S, P, k]
    else:
        local = (probs_g + expert_bias.to(probs_g.dtype).view(1, num_prototypes, group)).topk(top_k, dim=-1).indices
        raw_gate = probs_g.gather(-1, local)  # gates from the unbiased scores
    normalize = top_k > 1 and normalize_topk if normalize_routes is None else normalize_routes
    if normalize:
        gate = raw_gate / (raw_gate.sum(-1, keepdim=True) + _SIGMOID_EPS) if sigmoid else \
            raw_gate / raw_gate.sum(-1, keepdim=True)
    else:
        gate = raw_gate
    offset = torch.arange(num_prototypes, device=logits.device).view(1, -1, 1) * group
    expert_index = (local + offset).reshape(s, routes)

    eligible = None if token_mask is None else token_mask.unsqueeze(1).expand(s, routes)
    capacity = None if capacity_factor is None else expert_capacity(s, e, routes, capacity_factor, min_capacity)
    if rts_priority is not None:
        priority = rts_priority
    else:
        priority = raw_gate.detach().reshape(s, routes) if drop_policy == "probs" else None
    keep, slot, routed, kept = _assign_slots(expert_index, eligible, e, capacity, priority)

    aux_probs = probs_g / (probs_g.sum(-1, keepdim=True) + _SIGMOID_EPS) if sigmoid else probs_g
    if aux_loss_scope == "sequence":
        aux = sequence_aux_loss(aux_probs, expert_index, top_k, token_mask, sequence_length)
    elif aux_loss_scope == "global_batch" and global_load_fn is not None:
        used = torch.tensor(s, device=logits.device) if token_mask is None else token_mask.sum()
        global_routed, global_tokens = global_load_fn(routed, used)
        aux = global_batch_aux_loss(_masked_mean(aux_probs, token_mask), global_routed, global_tokens, top_k)
    else:
        aux = _prototype_aux_loss(aux_probs, routed, top_k, token_mask)
    return RoutingRecord(
        expert_index=expert_index,
        gate=gate.reshape(s, routes) * keep,
        slot=slot,
        keep=keep,
        tokens_per_expert=kept,
        routed_per_expert=routed,
        capacity=capacity,
        aux_loss=aux,
        z_loss=_z_loss_from_softmax(logits_g, local, raw_gate, token_mask)
        if not sigmoid and selection_noise is None and expert_bias is None
        else router_z_loss(logits, num_prototypes, token_mask),
    )


def _z_loss_from_softmax(logits_g: Tensor, local: Tensor, raw_gate: Tensor, token_mask: Optional[Tensor]) -> Tensor:
    """:func:`router_z_loss` from the softmax already taken: ``logsumexp = l_j - log p_j`` for any expert j.

    j is each group's first choice, its most probable expert when nothing but the scores chose
    (so ``p_j >= 1/G`` and the log is well conditioned); no second pass over the logits.
    """
    lse = logits_g.gather(-1, local[..., :1]).squeeze(-1) - raw_gate[..., 0].log()
    return _masked_mean(lse.square().mean(dim=1), token_mask)


def route_deepspeed_top1(logits: Tensor, capacity_factor: Optional[float], min_capacity: int,
                         used_token: Optional[Tensor] = None) -> RoutingRecord:
    """DeepSpeed 0.19.8 ``top1gating(use_rts=False, noisy_gate_policy=None)`` as a record.

    Same argmax, capacity (including its float32 arithmetic and the ``S >= min_capacity``
    check), same kept tokens - chosen, as DeepSpeed does without RTS, by
    ``torch.topk`` over the 0/1 mask (tie order, not token order) -, same slots
    (token order among kept), raw softmax gate, ``l_aux`` and ``exp_counts``.
    ``capacity_factor=None`` is ``drop_tokens=False`` (nothing dropped; capacity None).

    Example::

        rec = route_deepspeed_top1(torch.randn(64, 8), 1.0, 4)
    """
    s, e = _check_logits(logits)
    gates = F.softmax(logits, dim=1)
    index = torch.argmax(gates, dim=1)
    mask = F.one_hot(index, num_classes=e)
    if used_token is not None:
        # Same product (and dtype promotion) as DeepSpeed's einsum("s,se->se"): topk tie order depends on dtype.
        mask = used_token.reshape(s, 1) * mask
    routed = mask.sum(dim=0).long()
    aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * e

    if s < min_capacity:
        raise ValueError(f"top-1 DeepSpeed routing needs tokens ({s}) >= min_capacity ({min_capacity})")
    if capacity_factor is None:
        capacity = None
        kept_mask = mask
    else:
        capacity = _deepspeed_capacity(s, e, capacity_factor, min_capacity)
        # Without RTS DeepSpeed keeps topk(mask) rows per expert: reproduce that exact call for its tie order.
        top_idx = torch.topk(mask, k=min(capacity, s), dim=0)[1]
        kept_mask = mask * torch.zeros_like(mask).scatter_(0, top_idx, 1)
    locations = torch.cumsum(kept_mask, dim=0) - 1

    index = index.unsqueeze(1)
    keep = kept_mask.gather(1, index) > 0
    token_mask = None if used_token is None else used_token.reshape(s) != 0
    return RoutingRecord(
        expert_index=index,
        gate=gates.gather(1, index) * keep,
        slot=torch.where(keep, locations.gather(1, index).long(), -1),
        keep=keep,
        tokens_per_expert=(kept_mask > 0).sum(dim=0),
        routed_per_expert=routed,
        capacity=capacity,
        aux_loss=aux,
        z_loss=router_z_loss(logits, 1, token_mask),
    )


def route_deepspeed_top2(logits: Tensor, capacity_factor: Optional[float], min_capacity: int) -> RoutingRecord:
    """DeepSpeed 0.19.8 ``top2gating(top2_2nd_expert_sampling=False)`` as a record.

    1st choice = argmax of the softmax, 2nd = argmax of the logits without the 1st.
    Positional drops where, per expert, every 1st choice takes a slot before any 2nd
    choice (2nd-choice slots start after the expert's pre-drop 1st-choice count). The
    surviving gates are renormalised to sum to 1 (eps-clamped), so a token whose 2nd
    route was dropped keeps weight 1.0 on its 1st. ``l_aux`` uses 1st choices only.
    ``capacity_factor=None`` is ``drop_tokens=False``.

    Example::

        rec = route_deepspeed_top2(torch.randn(64, 8), 1.0, 4)
    """
    s, e = _check_logits(logits)
    gates = F.softmax(logits, dim=1)
    index1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(index1, num_classes=e)
    index2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(index2, num_classes=e)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * e * e
    routed = (mask1 + mask2).sum(dim=0)

    index = torch.stack([index1, index2], dim=1)
    slot = torch.stack([locations1.gather(1, index1[:, None]), locations2.gather(1, index2[:, None])], dim=1)[..., 0]
    if capacity_factor is None:
        capacity = None
        keep = torch.ones_like(index, dtype=torch.bool)
    else:
        capacity = _deepspeed_capacity(s, e, capacity_factor * 2, min_capacity)
        keep = slot < capacity
    gate = gates.gather(1, index) * keep
    gate = gate / gate.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gate.dtype).eps)
    return RoutingRecord(
        expert_index=index,
        gate=gate,
        slot=torch.where(keep, slot, -1),
        keep=keep,
        tokens_per_expert=torch.bincount(index[keep], minlength=e),
        routed_per_expert=routed,
        capacity=capacity,
        aux_loss=aux,
        z_loss=router_z_loss(logits),
    )


def _check_options(num_experts: int, score_function: str, expert_bias: Optional[Tensor],
                   selection_noise: Optional[Tensor], aux_loss_scope: str, sequence_length: Optional[int],
                   num_tokens: int) -> None:
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function={score_function!r} must be one of {SCORE_FUNCTIONS}")
    if aux_loss_scope not in AUX_LOSS_SCOPES:
        raise ValueError(f"aux_loss_scope={aux_loss_scope!r} must be one of {AUX_LOSS_SCOPES}")
    if expert_bias is not None:
        if tuple(expert_bias.shape) != (num_experts, ):
            raise ValueError(f"expert_bias must be [num_experts] = [{num_experts}], got {tuple(expert_bias.shape)}")
        if selection_noise is not None:
            raise ValueError("expert_bias and selection_noise both change the selection: use one of them")
    if aux_loss_scope == "sequence":
        if sequence_length is None or sequence_length < 1 or num_tokens % sequence_length:
            raise ValueError(f"aux_loss_scope='sequence' needs sequence_length >= 1 dividing the {num_tokens} "
                             f"tokens, got {sequence_length!r}")


def _check_logits(logits: Tensor) -> Tuple[int, int]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    return logits.shape[0], logits.shape[1]


def _token_mask(used_token: Optional[Tensor], s: int, device: torch.device) -> Optional[Tensor]:
    if used_token is None:
        return None
    if used_token.numel() != s:
        raise ValueError(f"used_token has {used_token.numel()} entries for {s} tokens")
    return used_token.reshape(s).to(device) != 0


def _masked_mean(values: Tensor, token_mask: Optional[Tensor]) -> Tensor:
    if token_mask is None:
        return values.mean(dim=0)
    weight = token_mask.to(values.dtype)
    shape = (-1, ) + (1, ) * (values.dim() - 1)
    return (values * weight.view(shape)).sum(dim=0) / weight.sum().clamp(min=1)


def _group_softmax(logits_g: Tensor) -> Tensor:
    """Softmax over the last dim of ``[S, P, G]``.

    CPU softmax over a last dim shorter than a vector register is slow, so there the softmax runs
    over the middle dim of a ``[P, G, S]`` copy instead. Results match ``F.softmax`` to within one ulp
    (not bit for bit: about a fifth of the values differ in the last bit).
    """
    if logits_g.device.type != "cpu" or logits_g.shape[-1] >= 16:
        return F.softmax(logits_g, dim=-1)
    return F.softmax(logits_g.permute(1, 2, 0).contiguous(), dim=1).permute(2, 0, 1).contiguous()


def _select_topk(logits_g: Tensor, probs_g: Tensor, top_k: int, noise: Optional[Tensor],
                 noise_from_choice: int) -> Tuple[Tensor, Tensor]:
    """Local expert ids ``[S, P, top_k]`` chosen inside each group, best first, and their probabilities.

    Without noise the probabilities come with the selection (``topk`` values, differentiable
    like the gather they replace), so no second pass over ``probs_g`` is run. For one choice
    on CPU, fp32 scores go to the C++ ``select_top1`` first, else ``max`` (both faster than
    ``topk``; benchmarks/RESULTS.md, "MoE layer"); both defer to ``topk`` when any row has a tied (or
    NaN) maximum, where CPU ``topk``'s tie order differs from the lowest index. The result is
    always ``topk``'s.
    """
    if noise is None:
        if top_k == 1 and probs_g.device.type == "cpu":
            ops = load_cpu_ops() if probs_g.dtype == torch.float32 else None
            if ops is not None:
                indices, unique = ops.select_top1(probs_g.detach().contiguous())
                if unique:  # else a tie or NaN somewhere: topk decides, below
                    return indices, probs_g.gather(-1, indices)
            values, indices = probs_g.max(dim=-1, keepdim=True)
            # max and topk agree whenever the maximum is unique; rows with a tie (or NaN) are the
            # only ones where CPU topk's choice can differ, so then topk decides, as before.
            if bool(((probs_g == values).sum(dim=-1) != 1).any()):
                values, indices = probs_g.topk(1, dim=-1)
            return indices, values
        values, indices = probs_g.topk(top_k, dim=-1)
        return indices, values
    noisy = logits_g + noise.reshape(logits_g.shape)
    if noise_from_choice == 0:
        local = noisy.topk(top_k, dim=-1).indices
    else:
        clean = probs_g.topk(noise_from_choice, dim=-1).indices
        rest = noisy.scatter(-1, clean, float("-inf")).topk(top_k - noise_from_choice, dim=-1).indices
        local = torch.cat([clean, rest], dim=-1)
    return local, probs_g.gather(-1, local)


def _assign_slots(expert_index: Tensor, eligible: Optional[Tensor], num_experts: int, capacity: Optional[int],
                  priority: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Capacity decisions and buffer rows; returns ``keep``, ``slot``, routed and kept counts per expert.

    Routes are ranked inside their expert by ``priority`` (higher first, ties to the
    lower token index) or by token index when ``priority`` is None; the first
    ``capacity`` ranks are kept. Kept routes then get rows in token order.
    ``eligible=None`` means every route is eligible.

    One stable sort of the S*K routes by expert gives every route its rank in token
    order, which is the answer for every expert within capacity. Only the routes of
    experts over capacity compete, so only they are sorted by priority (a few hundred
    routes instead of S*K).
    """
    s, k = expert_index.shape
    ops = load_cpu_ops() if expert_index.device.type == "cpu" and (
        priority is None or priority.dtype == torch.float32) else None
    if ops is not None:  # one pass in C++; it declines only for NaN priorities (argsort's NaN order decides)
        keep, slot, routed, kept, done = ops.assign_slots(
            expert_index.contiguous(), None if eligible is None else eligible.reshape(-1).contiguous(), num_experts,
            -1 if capacity is None else capacity, None if priority is None else priority.reshape(-1).contiguous())
        if done:
            return keep.view(s, k), slot.view(s, k), routed, kept
    flat = expert_index.reshape(-1)
    # Ineligible routes sort behind every expert (key E) so they take no rank.
    key = flat if eligible is None else torch.where(eligible.reshape(-1), flat, num_experts)
    counts = torch.bincount(key, minlength=num_experts + 1)
    routed = counts[:num_experts]
    rank = _rank_within_key(key, torch.argsort(key, stable=True), num_experts, counts)
    keep = key < num_experts
    if capacity is None or int(routed.max()) <= capacity:
        # Dropless, or no expert over capacity: nothing competes, every eligible route is kept.
        return keep.view(s, k), torch.where(keep, rank, -1).view(s, k), routed, routed
    kept = routed.clamp(max=capacity)
    if priority is None:
        keep = keep & (rank < capacity)
        return keep.view(s, k), torch.where(keep, rank, -1).view(s, k), routed, kept
    over = torch.cat([routed > capacity, routed.new_zeros(1, dtype=torch.bool)])
    cand = torch.nonzero(over[key]).squeeze(1)  # routes of over-capacity experts, in route (token) order
    cand_key = key[cand]
    by_priority = torch.argsort(priority.reshape(-1)[cand], descending=True, stable=True)
    cand_order = by_priority[torch.argsort(cand_key[by_priority], stable=True)]
    cand_keep = _rank_within_key(cand_key, cand_order, num_experts) < capacity
    keep = keep.index_put((cand, ), cand_keep)
    # The survivors of an over-capacity expert take its rows in token order.
    kept_cand = cand[cand_keep]
    kept_key = key[kept_cand]
    rank = rank.index_put((kept_cand, ), _rank_within_key(kept_key, torch.argsort(kept_key, stable=True),
                                                          num_experts))
    return keep.view(s, k), torch.where(keep, rank, -1).view(s, k), routed, kept


def _rank_within_key(key: Tensor, order: Tensor, num_experts: int, counts: Optional[Tensor] = None) -> Tensor:
    """Position of every element among those with the same key, following ``order``.

    ``counts`` is ``bincount(key, minlength=num_experts + 1)`` when the caller has it already.
    """
    sorted_key = key[order]
    if counts is None:
        counts = torch.bincount(key, minlength=num_experts + 1)
    starts = torch.cumsum(counts, dim=0) - counts
    rank = torch.empty_like(key)
    rank[order] = torch.arange(key.numel(), device=key.device) - starts[sorted_key]
    return rank


def _prototype_aux_loss(probs_g: Tensor, routed: Tensor, top_k: int, token_mask: Optional[Tensor]) -> Tensor:
    """``mean_p [E_g * sum_e f_pe * p_pe]`` with f from pre-drop routes (see :func:`route`)."""
    s, num_prototypes, group = probs_g.shape
    used = s if token_mask is None else token_mask.sum().clamp(min=1)
    f = routed.view(num_prototypes, group).to(probs_g.dtype) / (top_k * used)
    p = _masked_mean(probs_g, token_mask)
    return (group * (f * p).sum(dim=-1)).mean()


def _deepspeed_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    # DeepSpeed's _capacity rounds in float32 (python float times a float32 tensor); keep that arithmetic.
    capacity = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return max(int(capacity), min_capacity)
