"""An M6-T style decoder-only byte-level transformer with an MoE FFN every ``moe_every`` layers.

Pre-LN blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> FFN -> residual),
learned or rotary positions, byte embeddings tied to the output layer. Layer ``i`` (0-based)
has an :class:`moe_proto.MoE` FFN when ``(i + 1) % moe_every == 0`` and the model has
experts, a dense FFN otherwise; ``num_experts=0`` is the dense baseline. The training loss
is ``cross_entropy + aux_loss_coef * sum of the MoE layers' l_aux``.

Example::

    args = MoETransformerArgs(num_layers=4, d_model=128, num_heads=4, ffn_hidden_size=512,
                              num_experts=8, num_prototypes=2, moe_every=2)
    model = MoETransformerLM(args)
    out = model(tokens, targets)             # tokens, targets: [batch, seq] int64
    out.loss.backward()
    with torch.device("meta"):               # the full shape, no memory (the planner's way)
        big = MoETransformerLM(args)
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..args import RoutingOptions, SharedExpertOptions, routing_options_of
from ..buffer_pool import HostBufferPool, use_buffer_pool
from ..layer import MoEBase, moe_class
from ..router import router_config_of_block
from .config import DEFAULT_VOCAB, END_OF_DOCUMENT, MoEModelConfig

logger = logging.getLogger(__name__)

ROTARY_BASE = 10000.0


@dataclass(frozen=True)
class MoETransformerArgs(RoutingOptions, SharedExpertOptions):
    """Every argument of :class:`MoETransformerLM`.

    Shape: ``num_layers``, ``d_model``, ``num_heads``, ``ffn_hidden_size`` (dense FFN),
    ``expert_ffn_hidden_size`` (None: same as the dense FFN), ``vocab_size`` (256 bytes +
    end-of-document), ``max_seq_len``, ``positions`` (``"learned"`` or ``"rotary"``),
    ``activation``. MoE (as in the ``moe_proto`` block): ``num_experts`` (0: dense model),
    ``num_prototypes``, ``top_k`` (per prototype), ``moe_every``, capacity settings,
    ``dropless``, ``drop_policy``, ``ep_size``, ``aux_loss_coef``, ``z_loss_coef`` and the routing
    options ``expert_bias_update_rate``, ``score_function``, ``normalize_routes``, ``aux_loss_scope``,
    ``num_shared_experts``, ``shared_expert_ffn_hidden_size`` (docs/moe.md, "Routing options");
    ``zero_stage`` (3: build the layers for DeepSpeed's ZeRO stage 3, docs/moe.md "ZeRO-3").

    Example::

        MoETransformerArgs.from_configs(job.blocks["moe_model"], job.blocks.get("moe_proto"))
    """

    num_layers: int
    d_model: int
    num_heads: int
    ffn_hidden_size: int
    expert_ffn_hidden_size: Optional[int] = None
    vocab_size: int = DEFAULT_VOCAB
    max_seq_len: int = 256
    positions: str = "rotary"
    activation: str = "gelu"
    norm_eps: float = 1e-5
    init_std: float = 0.02
    num_experts: int = 0
    num_prototypes: int = 1
    top_k: int = 1
    moe_every: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    dropless: bool = False
    drop_policy: str = "probs"
    ep_size: int = 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    zero_stage: Optional[int] = None  # 3: the MoE layers are ZeRO3MoE (moe_class), the class ZeRO-3 accepts
    host_buffer_pool_mb: int = 1024  # the MoE layers' buffer pool (moe_proto/buffer_pool.py); 0: off

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"positions={self.positions!r} is not 'learned' or 'rotary'")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head size, got {self.head_dim}")
        if self.vocab_size <= END_OF_DOCUMENT:
            raise ValueError(f"vocab_size={self.vocab_size} must exceed {END_OF_DOCUMENT} (256 bytes + end-of-document)")
        if self.num_experts < 0 or self.moe_every < 1:
            raise ValueError(f"num_experts must be >= 0 and moe_every >= 1, got {self.num_experts}, {self.moe_every}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE FFN."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @classmethod
    def from_configs(cls, model: MoEModelConfig, moe: Optional[object] = None, **overrides) -> "MoETransformerArgs":
        """Build from the validated ``moe_model`` block and an optional ``moe_proto`` block (None: dense)."""
        kw = dict(num_layers=model.num_layers, d_model=model.d_model, num_heads=model.num_heads,
                  ffn_hidden_size=model.ffn_hidden_size, expert_ffn_hidden_size=model.expert_ffn_hidden_size,
                  vocab_size=model.vocab_size, max_seq_len=model.seq_len, positions=model.positions,
                  activation=model.activation, norm_eps=model.norm_eps, init_std=model.init_std)
        if moe is not None:
            kw.update(num_experts=moe.num_experts, num_prototypes=moe.num_prototypes, top_k=moe.top_k,
                      moe_every=moe.moe_every, capacity_factor=moe.capacity_factor,
                      eval_capacity_factor=moe.eval_capacity_factor, min_capacity=moe.min_capacity,
                      dropless=moe.dropless, drop_policy=moe.drop_policy, ep_size=moe.ep_size,
                      aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef,
                      host_buffer_pool_mb=moe.host_buffer_pool_mb, **routing_options_of(moe))
        kw.update(overrides)
        return cls(**kw)

    def replace(self, **changes) -> "MoETransformerArgs":
        return dataclasses.replace(self, **changes)


class LMOutput(NamedTuple):
    """``logits [B, S, V]``; ``aux_loss`` (sum over MoE layers, unscaled); the losses when targets were given."""

    logits: Tensor
    aux_loss: Tensor
    loss: Optional[Tensor] = None  # ce_loss + aux_loss_coef * aux_loss
    ce_loss: Optional[Tensor] = None


def rotary_tables(seq_len: int, head_dim: int, device: torch.device, base: float = ROTARY_BASE) -> tuple:
    """``(cos, sin)`` of shape ``[seq_len, head_dim // 2]`` for rotary position embeddings."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs ``(x[..., :h/2], x[..., h/2:])`` of ``x [B, H, S, h]`` by position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on ``F.scaled_dot_product_attention`` (fused kernels where available)."""

    def __init__(self, args: MoETransformerArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rotary = args.num_heads, args.head_dim, args.positions == "rotary"
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model, bias=False)
        self.proj = nn.Linear(args.d_model, args.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.rotary:
            cos, sin = rotary_tables(s, self.head_dim, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class DenseFFN(nn.Module):
    """``Linear -> activation -> Linear`` (SwiGLU: ``silu(x W1) * (x W3) -> W2``), no biases, like the experts."""

    def __init__(self, d_model: int, ffn_hidden_size: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.fc1 = nn.Linear(d_model, ffn_hidden_size, bias=False)
        self.fc3 = nn.Linear(d_model, ffn_hidden_size, bias=False) if activation == "swiglu" else None
        self.fc2 = nn.Linear(ffn_hidden_size, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.fc3 is not None:
            return self.fc2(F.silu(self.fc1(x)) * self.fc3(x))
        act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}.get(self.activation)
        h = F.gelu(self.fc1(x), approximate="tanh") if act is None else act(self.fc1(x))
        return self.fc2(h)


class Block(nn.Module):
    """One pre-LN transformer block; ``forward`` returns ``(x, l_aux)`` (``l_aux`` is 0 for a dense FFN)."""

    def __init__(self, args: MoETransformerArgs, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.attn = CausalSelfAttention(args)
        self.ln2 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.is_moe = moe
        if moe:
            # Routing noise (RTS, second-expert sampling) off: the blocks' routing comes from the config alone.
            # The routing fields as a moe_proto block gives them (moe_proto.router.router_config_of_block).
            self.ffn: nn.Module = moe_class(args.zero_stage)(
                args.d_model, None, ep_size=args.ep_size, activation=args.activation,
                ffn_hidden_size=args.expert_ffn, num_shared_experts=args.num_shared_experts,
                shared_expert_ffn_hidden_size=args.shared_expert_ffn_hidden_size,
                **dataclasses.asdict(router_config_of_block(args)))
        else:
            self.ffn = DenseFFN(args.d_model, args.ffn_hidden_size, args.activation)

    def forward(self, x: Tensor) -> tuple:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if self.is_moe:
            out, l_aux, _ = self.ffn(h)
            return x + out, l_aux
        return x + self.ffn(h), x.new_zeros((), dtype=torch.float32)


class MoETransformerLM(nn.Module):
    """The byte-level MoE language model (see the module docstring)."""

    def __init__(self, args: MoETransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_embed = nn.Embedding(args.max_seq_len, args.d_model) if args.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(args, args.is_moe_layer(i)) for i in range(args.num_layers))
        self.ln_f = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self._init_weights()
        # One pool for the model's MoE layers: a buffer one layer's backward frees serves the next layer's.
        use_buffer_pool(self, HostBufferPool(max_bytes=args.host_buffer_pool_mb << 20))
        logger.info("MoETransformerLM: %d layers (%d MoE), d_model %d, %d experts", args.num_layers,
                    args.num_moe_layers, args.d_model, args.num_experts)

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, std) embeddings and attention, residual projections scaled down by depth;
        # FFNs keep nn.Linear's uniform 1/sqrt(fan_in) init so dense and expert FFNs start alike.
        std = self.args.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=std)
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.proj.weight, std=std / math.sqrt(2 * self.args.num_layers))

    def moe_layers(self) -> List[MoEBase]:
        """The MoE FFN layers, in depth order (for their ``last_stats``)."""
        return [b.ffn for b in self.blocks if b.is_moe]

    def forward(self, tokens: Tensor, targets: Optional[Tensor] = None) -> LMOutput:
        """``tokens [B, S]`` -> :class:`LMOutput`; with ``targets [B, S]`` also the mean losses."""
        b, s = tokens.shape
        if s > self.args.max_seq_len and self.pos_embed is not None:
            raise ValueError(f"sequence of {s} tokens exceeds max_seq_len={self.args.max_seq_len}")
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(s, device=tokens.device))
        aux = torch.zeros((), device=tokens.device)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = F.linear(self.ln_f(x), self.embed.weight)  # tied byte embeddings
        if targets is None:
            return LMOutput(logits, aux)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return LMOutput(logits, aux, ce + self.args.aux_loss_coef * aux, ce)
