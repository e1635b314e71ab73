"""The target model: a stack of `DecoderLayer`s loaded from a Hugging Face folder's safetensors files
through an explicit name map, run over one flattened batch of every scheduled token."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from heads.hf_folder import read_config, read_tensors
from heads.layer import DecoderLayer, LayerConfig, RMSNorm
from heads.rope import Rope, rope_settings
from serving.attention import AttentionPath, PagedAttention
from serving.kernels import FusedRMSNorm, KernelForward, KernelLayer, PackedLinear, for_inference, kernel_layers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")

# Hugging Face name -> (our name, shard index inside a fused tensor or None); `{}` is the layer index.
WEIGHT_MAP = {
    "model.embed_tokens.weight": ("embed.weight", None),
    "model.norm.weight": ("norm.weight", None),
    "lm_head.weight": ("lm_head.weight", None),
    "model.layers.{}.input_layernorm.weight": ("layers.{}.input_norm.weight", None),
    "model.layers.{}.post_attention_layernorm.weight": ("layers.{}.post_norm.weight", None),
    "model.layers.{}.self_attn.q_proj.weight": ("layers.{}.qkv.weight", 0),
    "model.layers.{}.self_attn.k_proj.weight": ("layers.{}.qkv.weight", 1),
    "model.layers.{}.self_attn.v_proj.weight": ("layers.{}.qkv.weight", 2),
    "model.layers.{}.self_attn.q_proj.bias": ("layers.{}.qkv.bias", 0),
    "model.layers.{}.self_attn.k_proj.bias": ("layers.{}.qkv.bias", 1),
    "model.layers.{}.self_attn.v_proj.bias": ("layers.{}.qkv.bias", 2),
    "model.layers.{}.self_attn.q_norm.weight": ("layers.{}.q_norm.weight", None),
    "model.layers.{}.self_attn.k_norm.weight": ("layers.{}.k_norm.weight", None),
    "model.layers.{}.self_attn.o_proj.weight": ("layers.{}.o.weight", None),
    "model.layers.{}.mlp.gate_proj.weight": ("layers.{}.gate_up.weight", 0),
    "model.layers.{}.mlp.up_proj.weight": ("layers.{}.gate_up.weight", 1),
    "model.layers.{}.mlp.down_proj.weight": ("layers.{}.down.weight", None),
}


def _map_name(hf_name: str):
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            pattern = ".".join(parts[:i] + ["{}"] + parts[i + 1:])
            if pattern in WEIGHT_MAP:
                ours, shard = WEIGHT_MAP[pattern]
                return ours.format(part), shard
    return WEIGHT_MAP.get(hf_name, (None, None))


@dataclass
class ModelConfig:
    architecture: str
    num_layers: int
    vocab_size: int
    layer: LayerConfig
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_folder(cls, folder) -> "ModelConfig":
        folder = Path(folder)
        config = read_config(folder)
        architecture = (config.get("architectures") or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{folder}: architecture {architecture} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        theta, scaling = rope_settings(config)
        eos = config.get("eos_token_id")
        generation = folder / "generation_config.json"
        if generation.exists():
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        return cls(
            architecture=architecture,
            num_layers=config["num_hidden_layers"],
            vocab_size=config["vocab_size"],
            layer=LayerConfig.from_hf(config),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )


class ForwardPath(enum.Enum):
    """How Model.forward computes a step (Model.forward_path chooses).

    Where serving/kernels.c runs (built for this CPU, float32 weights on CPU: serving.kernels.library), loading makes
    the layers KernelLayers (three C calls each) and a KernelForward over them; elsewhere they stay DecoderLayers of
    torch operators. A step then runs in one C call when every sequence of it attends in the C kernel, since the Python
    and torch calls between layers cost more than their arithmetic at a decode step's few rows; a step with a prefill
    chunk (AttentionPath.KERNEL_AND_LONG), a drafter's early exit or training's dense attention runs the layer loop."""
    ONE_CALL = "KernelForward: embedding to argmax in one model_forward call"
    KERNEL_LAYERS = "a loop over KernelLayers"
    TORCH_LAYERS = "a loop over DecoderLayers"


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [num_logits_rows, vocab]
    hidden: torch.Tensor | None  # [num_tokens, hidden] after the final norm, when asked
    aux: dict[int, torch.Tensor]  # layer id -> [num_tokens, hidden], the input of that layer
    argmax: list[int] | None = None  # each logits row's most likely token, where the forward computed it


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.layer.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c.layer, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.layer.hidden_size, c.layer.rms_norm_eps)
        # the LM head as the checkpoint holds it (the embedding, where tied): the source of the packed copies, the
        # forward's `packed_lm_head` and each drafter weight dtype's (`drafter_lm_head`)
        self.lm_head = nn.Linear(c.layer.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = Rope(c.layer.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
        self._drafter_lm_heads: dict[torch.dtype, PackedLinear] = {}  # not submodules: made for drafters on demand
        self.fused: KernelForward | None = None  # the forward in one C call, where the layers are KernelLayers

    @classmethod
    def from_folder(cls, folder, dtype=torch.float32, device="cpu", weights=torch.float32) -> "Model":
        """weights=torch.bfloat16 stores the linear layers' and the LM head's packed weights rounded to bfloat16
        (serving.kernels.PackedLinear); the embedding and the norms stay in `dtype`."""
        folder = Path(folder)
        with torch.device(device):  # built where it runs, its weights then copied in
            model = cls(ModelConfig.from_folder(folder))
        model.load_safetensors(folder)
        model.to(dtype=dtype).eval().requires_grad_(False)  # the rope tables stay float32
        model.layers = kernel_layers(for_inference(model.layers, weights), model.config.layer)
        model.norm = FusedRMSNorm(model.norm)
        model.packed_lm_head = PackedLinear(model.lm_head, weights)  # a packed copy for forward; the embedding stays as it is
        if isinstance(model.layers[0], KernelLayer):
            model.fused = KernelForward(model.layers, model.embed, model.rope, model.norm, model.packed_lm_head)
        return model

    def drafter_lm_head(self, weight_dtype: torch.dtype) -> PackedLinear:
        """The LM head packed with its weights stored as weight_dtype, for drafters: the forward's own where its dtype
        is that one; else made once per dtype."""
        if weight_dtype == self.packed_lm_head.weight_dtype or self.lm_head.weight.dtype != torch.float32:
            return self.packed_lm_head
        if weight_dtype not in self._drafter_lm_heads:
            self._drafter_lm_heads[weight_dtype] = PackedLinear(self.lm_head, weight_dtype)
        return self._drafter_lm_heads[weight_dtype]

    def load_safetensors(self, folder: Path):
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for hf_name, tensor in read_tensors(folder).items():
            ours, shard = _map_name(hf_name)
            if ours is None:
                raise ValueError(f"{folder}: unexpected tensor {hf_name} (not in serving.model.WEIGHT_MAP)")
            shards.setdefault(ours, {})[shard or 0] = tensor
        own = dict(self.named_parameters(remove_duplicate=False))
        expected = {n for n in own if not (self.config.tie_word_embeddings and n == "lm_head.weight")}
        missing = expected - shards.keys()
        if missing:
            raise ValueError(f"{folder}: missing weights for {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, parts in shards.items():
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                tensor = torch.cat([parts[i] for i in sorted(parts)]) if len(parts) > 1 else parts[0]
                if own[name].shape != tensor.shape:
                    raise ValueError(f"{folder}: {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
                own[name].copy_(tensor)

    def forward_path(self, attention) -> ForwardPath:
        """The path of a step attending through `attention` (ForwardPath says why)."""
        if self.fused is not None and isinstance(attention, PagedAttention) and attention.path is AttentionPath.KERNEL:
            return ForwardPath.ONE_CALL
        return ForwardPath.KERNEL_LAYERS if isinstance(self.layers[0], KernelLayer) else ForwardPath.TORCH_LAYERS

    @torch.inference_mode()
    def forward(self, input_ids, positions, attention, logits_rows=None, return_hidden=False, aux_layers=(),
                num_layers=None):
        """input_ids, positions: [num_tokens]; attention: the step's PagedAttention, or any callable
        (layer_idx, q, k, v) -> output (training's dense attention); logits_rows: rows that need logits (None: all);
        num_layers: run only the first layers, then the final norm and LM head (early-exit drafting)."""
        stop = len(self.layers) if num_layers is None else num_layers
        if self.forward_path(attention) is ForwardPath.ONE_CALL:
            logits, best, hidden, aux = self.fused(input_ids, positions, attention.paged_kv(), logits_rows,
                                                   return_hidden, aux_layers, stop)
            return ModelOutput(logits, hidden, aux, best)
        hidden = self.embed(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rope.tables(positions, hidden.dtype)
        aux = {}
        for layer in self.layers[:stop]:
            if layer.layer_idx in aux_layers:
                aux[layer.layer_idx] = hidden
            hidden = layer(hidden, cos, sin, attention)
        if return_hidden:
            hidden = self.norm(hidden)
            selected = hidden if logits_rows is None else hidden[logits_rows]
        else:
            selected = self.norm(hidden if logits_rows is None else hidden[logits_rows])
        logits = self.packed_lm_head(selected).float() if logits_rows is None or len(logits_rows) else None
        return ModelOutput(logits, hidden if return_hidden else None, aux)
