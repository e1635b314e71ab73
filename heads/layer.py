"""The one decoder layer (Llama family: Llama, Qwen2, Qwen3, Mistral; Qwen3-MoE's and gpt-oss's sparse MLPs;
Gemma 3's GeLU MLP and norms around the attention's and the MLP's outputs; gpt-oss's attention sinks and output
bias) with its attention injected.

The target in the engine, the EAGLE layers, the MTP blocks and DFlash's layers all run this layer. Attention is a
callable `attention(layer_idx, q, k, v) -> out` over `[..., heads, head_dim]` tensors: dense causal
attention in training, paged attention in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.rope import apply_rope


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP as Qwen3-MoE has it: a softmax router over `num_experts` SwiGLU experts of width
    `intermediate_size`, each row summed over its top `num_experts_per_tok`, their weights renormalised to sum to 1
    where `norm_topk_prob`. `dense_layers` keep a dense MLP (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)."""
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: biased router and experts, the softmax over the top-k logits only, and a clamped SwiGLU
    # ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit) over interleaved gate and up columns
    biases: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    @classmethod
    def from_hf(cls, config: dict) -> "MoeConfig | None":
        num_experts = config.get("num_experts", config.get("num_local_experts")) or 0
        if not num_experts:
            return None
        if config["model_type"] == "gpt_oss":
            return cls(num_experts, config["num_experts_per_tok"], config["intermediate_size"], True, biases=True,
                       softmax_after_topk=True, swiglu_limit=config["swiglu_limit"], swiglu_alpha=config["swiglu_alpha"])
        step = config.get("decoder_sparse_step", 1)
        only_mlp = set(config.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(config["num_hidden_layers"]) if i in only_mlp or (i + 1) % step)
        return cls(num_experts, config["num_experts_per_tok"], config["moe_intermediate_size"],
                   config.get("norm_topk_prob", False), dense)


@dataclass
class LayerConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 derives hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    attention_input_size: int = 0  # 0 means hidden_size; EAGLE-3 attends over 2 * hidden
    moe: MoeConfig | None = None  # a sparse MLP (a target's; draft layers are dense)
    activation: str = "silu"  # of the MLP's gate: silu, or gelu_tanh (Gemma)
    sandwich_norms: bool = False  # Gemma: RMSNorms on the attention's and the MLP's outputs too
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power (Gemma); 0: head_dim's (attention_scale)
    o_bias: bool = False  # gpt-oss
    sinks: bool = False  # gpt-oss: a learned logit per head beside the keys, which takes softmax mass and gives nothing

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        self.attention_input_size = self.attention_input_size or self.hidden_size
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {', '.join(ACTIVATIONS)}")

    @property
    def attention_scale(self) -> float:
        """What attention scales scores by (the attention applies it: serving.attention.KVCache carries it)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_llama(self) -> bool:
        """Whether the layer is the Llama family's (a dense SwiGLU MLP, two norms, the usual scale): what
        serving/kernels.c's layers compute."""
        return (self.moe is None and self.activation == "silu" and not self.sandwich_norms and not self.o_bias
                and not self.sinks)

    @classmethod
    def from_hf(cls, config: dict) -> "LayerConfig":
        return cls(
            hidden_size=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            head_dim=config.get("head_dim") or 0,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            qkv_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
            qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe", "gemma3_text"),
            **(dict(activation="gelu_tanh", sandwich_norms=True, query_pre_attn_scalar=config["query_pre_attn_scalar"])
               if config.get("model_type") == "gemma3_text" else {}),
            **(dict(o_bias=config["attention_bias"], sinks=True) if config.get("model_type") == "gpt_oss" else {}),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one kernel
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 whatever the dtype, and scale after casting back, as the reference implementations do.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: LayerConfig, layer_idx: int = 0, input_norm: bool = True):
        super().__init__()
        c = config
        self.config, self.layer_idx = c, layer_idx
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_norm = RMSNorm(c.attention_input_size, c.rms_norm_eps) if input_norm else nn.Identity()
        self.qkv = nn.Linear(c.attention_input_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.o = nn.Linear(self.q_size, c.hidden_size, bias=c.o_bias)
        if c.sinks:  # read by the attention (serving.attention.KVCache.sinks)
            self.sinks = nn.Parameter(torch.zeros(c.num_heads))
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.sandwich_norms:
            self.attn_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.mlp_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.act = ACTIVATIONS[c.activation]
        self.experts = None
        if c.moe is not None and layer_idx not in c.moe.dense_layers:
            self.experts = SparseMoe(c.hidden_size, c.moe)
        else:
            self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
            self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, hidden, cos, sin, attention, attention_input=None):
        """hidden: [..., hidden]; attention_input replaces input_norm(hidden) when the caller builds it
        (EAGLE-3 concatenates two normed streams)."""
        x = self.input_norm(hidden) if attention_input is None else attention_input
        q, k, v = self.project(x, cos, sin)
        attended = self.o(attention(self.layer_idx, q, k, v).flatten(-2))
        hidden = hidden + (self.attn_out_norm(attended) if self.config.sandwich_norms else attended)
        x = self.post_norm(hidden)
        if self.experts is not None:
            out = self.experts(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            out = self.down(self.act(gate) * up)
        return hidden + (self.mlp_out_norm(out) if self.config.sandwich_norms else out)

    def project(self, x, cos, sin):
        """x: [..., attention_input] (already normed) -> q [..., heads, head_dim], k, v [..., kv_heads, head_dim],
        q and k normed (Qwen3) and rotated to the positions of cos/sin. DFlash also calls it on the target's fused
        features, whose k and v its blocks attend to beside their own."""
        c = self.config
        qkv = self.qkv(x)
        qk = qkv[..., :self.q_size + self.kv_size].unflatten(-1, (c.num_heads + c.num_kv_heads, c.head_dim))
        v = qkv[..., self.q_size + self.kv_size:].unflatten(-1, (c.num_kv_heads, c.head_dim))
        if c.qk_norm:
            qk = torch.cat([self.q_norm(qk[..., :c.num_heads, :]), self.k_norm(qk[..., c.num_heads:, :])], dim=-2)
        qk = apply_rope(qk, cos, sin)  # the query and key heads in one go
        return qk[..., :c.num_heads, :], qk[..., c.num_heads:, :], v


class SparseMoe(nn.Module):
    """Each row through its top-k experts (MoeConfig), the experts run one after another over the rows routed to
    them, in ascending expert order: a row's sum has the same order, and so the same bits, in any batch."""

    def __init__(self, hidden_size: int, config: MoeConfig):
        super().__init__()
        self.config = config
        c = config
        self.router = nn.Linear(hidden_size, c.num_experts, bias=c.biases)
        self.gate_up = nn.ModuleList(nn.Linear(hidden_size, 2 * c.intermediate_size, bias=c.biases)
                                     for _ in range(c.num_experts))
        self.down = nn.ModuleList(nn.Linear(c.intermediate_size, hidden_size, bias=c.biases) for _ in range(c.num_experts))

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, k] weights, [rows, k] experts) of each row's top k."""
        c, logits = self.config, self.router(rows).float()
        if c.softmax_after_topk:
            top, experts = logits.topk(c.num_experts_per_tok, dim=-1)
            return top.softmax(dim=-1), experts
        weights, experts = logits.softmax(dim=-1).topk(c.num_experts_per_tok, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True) if c.norm_topk_prob else weights), experts

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not c.swiglu_limit:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=c.swiglu_limit), up.clamp(-c.swiglu_limit, c.swiglu_limit)
        return (up + 1) * gate * torch.sigmoid(gate * c.swiglu_alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [rows, hidden]
        weights, experts = self.route(rows)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(rows)
        for expert in experts.unique().tolist():
            routed, slot = (experts == expert).nonzero(as_tuple=True)
            gate, up = self.gate_up[expert](rows[routed]).chunk(2, dim=-1)
            out.index_add_(0, routed, self.down[expert](self.activate(gate, up)) * weights[routed, slot, None])
        return out.view_as(x)
