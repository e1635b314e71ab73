"""The target model: a stack of `DecoderLayer`s loaded from a Hugging Face folder's safetensors files
through an explicit name map, run over one flattened batch of every scheduled token."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from heads.hf_folder import read_config, read_tensors
from heads.layer import DecoderLayer, LayerConfig, MoeConfig, RMSNorm
from heads.rope import Rope, local_rope_settings, rope_settings
from heads.target_parts import NORM_OFFSETS
from heads.text_model import TEXT_ARCHITECTURES, is_multimodal, text_architecture, text_config, text_name
from serving.attention import AttentionPath, PagedAttention
from serving.kernels import FusedRMSNorm, KernelForward, KernelLayer, PackedLinear, for_inference, kernel_layers
from serving import weight_arena
from serving.targets import generation_limits

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")

# Hugging Face name -> (our name, shard index inside a fused tensor or None); each `{}` an index (layer, expert).
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
    "model.layers.{}.mlp.gate.weight": ("layers.{}.experts.router.weight", None),
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": ("layers.{}.experts.gate_up.{}.weight", 0),
    "model.layers.{}.mlp.experts.{}.up_proj.weight": ("layers.{}.experts.gate_up.{}.weight", 1),
    "model.layers.{}.mlp.experts.{}.down_proj.weight": ("layers.{}.experts.down.{}.weight", None),
}


# Gemma 3 names its norms after where they sit: around the attention's output and around the MLP.
GEMMA3_WEIGHT_MAP = {
    **WEIGHT_MAP,
    "model.layers.{}.post_attention_layernorm.weight": ("layers.{}.attn_out_norm.weight", None),
    "model.layers.{}.pre_feedforward_layernorm.weight": ("layers.{}.post_norm.weight", None),
    "model.layers.{}.post_feedforward_layernorm.weight": ("layers.{}.mlp_out_norm.weight", None),
}
# gpt-oss keeps its router in mlp.router, a sink logit per head, and its experts fused (gpt_oss_experts splits them).
GPT_OSS_WEIGHT_MAP = {
    **WEIGHT_MAP,
    "model.layers.{}.self_attn.o_proj.bias": ("layers.{}.o.bias", None),
    "model.layers.{}.self_attn.sinks": ("layers.{}.sinks", None),
    "model.layers.{}.mlp.router.weight": ("layers.{}.experts.router.weight", None),
    "model.layers.{}.mlp.router.bias": ("layers.{}.experts.router.bias", None),
}
WEIGHT_MAPS = {"gemma3_text": GEMMA3_WEIGHT_MAP, "gpt_oss": GPT_OSS_WEIGHT_MAP}


def gpt_oss_experts(hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """gpt-oss's fused expert tensors as each expert's Linear weights and biases: gate_up_proj [E, hidden, 2I] holds
    gate and up in alternate columns (x @ W), here [gate; up] rows; down_proj [E, I, hidden]. None for other names."""
    if not hf_name.startswith("model.layers.") or ".mlp.experts." not in hf_name:
        return None
    layer, name = hf_name.split(".")[2], hf_name.split(".")[-1]
    ours = f"layers.{layer}.experts"
    if name == "gate_up_proj":
        return {f"{ours}.gate_up.{e}.weight": torch.cat([w[:, ::2], w[:, 1::2]], dim=1).t() for e, w in enumerate(tensor)}
    if name == "gate_up_proj_bias":
        return {f"{ours}.gate_up.{e}.bias": torch.cat([b[::2], b[1::2]]) for e, b in enumerate(tensor)}
    if name == "down_proj":
        return {f"{ours}.down.{e}.weight": w.t() for e, w in enumerate(tensor)}
    if name == "down_proj_bias":
        return {f"{ours}.down.{e}.bias": b for e, b in enumerate(tensor)}
    return None


def _map_name(hf_name: str, weight_map: dict = WEIGHT_MAP):
    parts = hf_name.split(".")
    indices = [part for part in parts if part.isdigit()]
    pattern = ".".join("{}" if part.isdigit() else part for part in parts)
    if pattern not in weight_map:
        return None, None
    ours, shard = weight_map[pattern]
    return ours.format(*indices), shard


def layer_windows(config: dict) -> tuple[int, ...]:
    """Each layer's sliding window in keys (0: it sees the whole context): the layers `layer_types` calls
    sliding_attention (Gemma 3, and transformers' other configs that list them), else every layer where the config
    sets `sliding_window` (and does not switch it off with use_sliding_window, as Qwen's do)."""
    window = config.get("sliding_window") or 0
    types = config.get("layer_types")
    if types is not None:
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return (window if config.get("use_sliding_window", True) else 0,) * config["num_hidden_layers"]


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
    windows: tuple[int, ...] = ()  # per layer, 0 where it attends to every key
    local_rope: tuple[float, dict | None] | None = None  # the windowed layers' own (theta, scaling) (Gemma 3)
    embed_scale: float = 1.0  # the embedding's multiplier (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's norms scale by 1 + w)
    model_type: str = ""
    multimodal: bool = False  # the language model of a multimodal checkpoint: its other tensors are not loaded

    @classmethod
    def from_folder(cls, folder) -> "ModelConfig":
        folder = Path(folder)
        top = read_config(folder)
        architecture, config = text_architecture(top), text_config(top)
        if architecture not in SUPPORTED_ARCHITECTURES:
            multimodal = (f" (the language model of this multimodal checkpoint is {config.get('model_type')!r}; the "
                          f"engine runs the language model of {', '.join(TEXT_ARCHITECTURES)} checkpoints)"
                          if is_multimodal(top) else "")
            raise ValueError(f"{folder}: the engine does not run {architecture}{multimodal} (it runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}). Heads for it train all the same: capture the "
                             "store's hidden states with `draftheads generate --capture transformers` (or vllm) over "
                             "answers from --endpoint or --answers dataset, and serve the exported head in vLLM")
        theta, scaling = rope_settings(config)
        eos_token_ids, max_position_embeddings = generation_limits(folder)
        is_gemma = config["model_type"] == "gemma3_text"
        return cls(
            architecture=architecture,
            num_layers=config["num_hidden_layers"],
            vocab_size=config["vocab_size"],
            layer=replace(LayerConfig.from_hf(config), moe=MoeConfig.from_hf(config)),
            max_position_embeddings=max_position_embeddings,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            eos_token_ids=eos_token_ids,
            windows=layer_windows(config),
            local_rope=local_rope_settings(config),
            embed_scale=config["hidden_size"] ** 0.5 if is_gemma else 1.0,
            norm_offset=NORM_OFFSETS.get(config["model_type"], 0.0),
            model_type=config["model_type"],
            multimodal=is_multimodal(top),
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
        self.local_rope = None if c.local_rope is None else Rope(c.layer.head_dim, c.max_position_embeddings, *c.local_rope)
        # not submodules: made for drafters on demand, per (weight dtype, compute)
        self._drafter_lm_heads: dict[tuple[torch.dtype, torch.dtype], PackedLinear] = {}
        self.fused: KernelForward | None = None  # the forward in one C call, where the layers are KernelLayers
        self.weight_arena: torch.Tensor | None = None  # the packed weights' one allocation (serving/weight_arena.py)

    @classmethod
    def from_folder(cls, folder, dtype=torch.float32, device="cpu", weights=torch.float32,
                    compute=torch.float32) -> "Model":
        """weights=torch.bfloat16 stores the linear layers' and the LM head's packed weights rounded to bfloat16
        (serving.kernels.PackedLinear); the embedding and the norms stay in `dtype`. compute=torch.bfloat16 (with
        bfloat16 weights) also rounds every product's input to bfloat16; the rest of the forward (the residual
        stream, norms, rope, attention, the logits) stays in `dtype`."""
        folder = Path(folder)
        with torch.device(device):  # built where it runs, its weights then copied in
            model = cls(ModelConfig.from_folder(folder))
        model.load_safetensors(folder)
        model.to(dtype=dtype).eval().requires_grad_(False)  # the rope tables stay float32
        layers = for_inference(model.layers, weights, compute)
        # a packed copy for forward; the embedding stays as it is
        model.packed_lm_head = PackedLinear(model.lm_head, weights, compute)
        model.weight_arena = weight_arena.place([*(m for m in layers.modules() if isinstance(m, PackedLinear)),
                                                 model.packed_lm_head])
        model.layers = kernel_layers(layers, model.config.layer)
        model.norm = FusedRMSNorm(model.norm)
        if isinstance(model.layers[0], KernelLayer) and not any(model.config.windows):  # model_forward has no windows
            model.fused = KernelForward(model.layers, model.embed, model.rope, model.norm, model.packed_lm_head)
        return model

    def drafter_lm_head(self, weight_dtype: torch.dtype, compute: torch.dtype = torch.float32) -> PackedLinear:
        """The LM head packed with its weights stored as weight_dtype and products in `compute`, for drafters: the
        forward's own where it is packed so; else made once per (weight dtype, compute)."""
        head = self.packed_lm_head
        if self.lm_head.weight.dtype != torch.float32 or (weight_dtype, compute) == (head.weight_dtype, head.compute):
            return head
        if (weight_dtype, compute) not in self._drafter_lm_heads:
            self._drafter_lm_heads[weight_dtype, compute] = PackedLinear(self.lm_head, weight_dtype, compute)
        return self._drafter_lm_heads[weight_dtype, compute]

    def load_safetensors(self, folder: Path):
        shards: dict[str, dict[int, torch.Tensor]] = {}
        weight_map = WEIGHT_MAPS.get(self.config.model_type, WEIGHT_MAP)
        for hf_name, tensor in read_tensors(folder).items():
            if self.config.multimodal:  # the language model's tensors under their causal LM names; no vision tower
                hf_name = text_name(hf_name)
                if hf_name is None:
                    continue
            experts = gpt_oss_experts(hf_name, tensor) if self.config.model_type == "gpt_oss" else None
            if experts is not None:
                shards.update({name: {0: part} for name, part in experts.items()})
                continue
            ours, shard = _map_name(hf_name, weight_map)
            if ours is not None and ours.endswith("norm.weight"):
                tensor = tensor + self.config.norm_offset
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

    def attention_sinks(self) -> tuple[torch.Tensor | None, ...]:
        """Each layer's sink logits (gpt-oss), float32 for the attention kernel; None where a layer has none."""
        if not self.config.layer.sinks:  # the layers with sinks are DecoderLayers (LayerConfig.is_llama)
            return (None,) * len(self.layers)
        return tuple(layer.sinks.float().contiguous() for layer in self.layers)

    def forward_path(self, attention) -> ForwardPath:
        """The path of a step attending through `attention` (ForwardPath says why)."""
        if self.fused is not None and isinstance(attention, PagedAttention) and attention.path is AttentionPath.KERNEL:
            return ForwardPath.ONE_CALL
        return ForwardPath.KERNEL_LAYERS if isinstance(self.layers[0], KernelLayer) else ForwardPath.TORCH_LAYERS

    def forward(self, input_ids, positions, attention, logits_rows=None, return_hidden=False, aux_layers=(),
                num_layers=None):
        """input_ids, positions: [num_tokens]; attention: the step's PagedAttention, or any callable
        (layer_idx, q, k, v) -> output (training's dense attention); logits_rows: rows that need logits (None: all);
        num_layers: run only the first layers, then the final norm and LM head (early-exit drafting)."""
        stop = len(self.layers) if num_layers is None else num_layers
        if self.forward_path(attention) is ForwardPath.ONE_CALL:  # no autograd to switch off: no torch operator runs
            logits, best, hidden, aux = self.fused(input_ids, positions, attention.paged_kv(), logits_rows,
                                                   return_hidden, aux_layers, stop)
            return ModelOutput(logits, hidden, aux, best)
        with torch.inference_mode():
            return self.layers_forward(input_ids, positions, attention, logits_rows, return_hidden, aux_layers, stop)

    def layers_forward(self, input_ids, positions, attention, logits_rows, return_hidden, aux_layers, stop):
        """forward's operator by operator path (ForwardPath.KERNEL_LAYERS or TORCH_LAYERS), through layer `stop`."""
        hidden = self.embed(input_ids)  # [num_tokens, hidden]
        if self.config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        tables = self.rope.tables(positions, hidden.dtype)
        local = tables if self.local_rope is None else self.local_rope.tables(positions, hidden.dtype)
        windows = self.config.windows
        aux = {}
        for layer in self.layers[:stop]:
            if layer.layer_idx in aux_layers:
                aux[layer.layer_idx] = hidden
            cos, sin = local if windows and windows[layer.layer_idx] else tables
            hidden = layer(hidden, cos, sin, attention)
        if return_hidden:
            hidden = self.norm(hidden)
            selected = hidden if logits_rows is None else hidden[logits_rows]
        else:
            selected = self.norm(hidden if logits_rows is None else hidden[logits_rows])
        logits = self.packed_lm_head(selected).float() if logits_rows is None or len(logits_rows) else None
        return ModelOutput(logits, hidden if return_hidden else None, aux)
