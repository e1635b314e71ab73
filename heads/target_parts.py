"""The frozen pieces of a target that draft heads read: token embedding, final norm and LM head, with the
target's numbers a head copies into its config (layer sizes, rope settings, layer and vocabulary counts).

`load_target_parts` reads only those three tensors and config.json from a Hugging Face folder, so a head can
train or draft without loading the target's decoder layers. A multimodal checkpoint's language model is read the
same way (heads/text_model.py: its `text_config`, its tensors under a prefix).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from heads.hf_folder import read_config, read_tensors
from heads.layer import LayerConfig, RMSNorm
from heads.rope import rope_settings
from heads.text_model import TEXT_PREFIXES, checkpoint_names, text_config

EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# Families whose RMSNorms scale by (offset + w): their norm weights are stored as w, and loaded as offset + w.
NORM_OFFSETS = {"gemma3_text": 1.0}


class TargetParts(nn.Module):
    """`embed`, `norm` and `lm_head` of a target, frozen. A head binds to them without registering them, so
    they never enter its state_dict or optimizer; move them with `parts.to(...)` beside the head.

    `fingerprint` is the target's identity (serving.targets.fingerprint) when the caller knows it: heads
    record it and refuse a different target."""

    def __init__(self, layer: LayerConfig, *, num_layers: int, vocab_size: int, max_position_embeddings: int,
                 rope_theta: float, rope_scaling: dict | None, model_type: str, tie_word_embeddings: bool,
                 fingerprint: dict | None = None, device=None):
        super().__init__()
        self.layer, self.num_layers, self.vocab_size = layer, num_layers, vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.model_type, self.tie_word_embeddings = model_type, tie_word_embeddings
        self.fingerprint = fingerprint
        self.embed = nn.Embedding(vocab_size, layer.hidden_size, device=device)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = nn.Linear(layer.hidden_size, vocab_size, bias=False, device=device)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    def describe(self) -> dict:
        """What a head checks itself against: the fingerprint when known, and the sizes always."""
        return {**(self.fingerprint or {}), "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "num_layers": self.num_layers}


def load_target_parts(folder, dtype: torch.dtype = torch.float32, device="cpu",
                      fingerprint: dict | None = None, weights: bool = True) -> TargetParts:
    """Embedding, final norm and LM head of the Hugging Face model in `folder` (a multimodal one's language
    model); the LM head is the embedding when config.json ties them or the weights hold no LM head. weights=False
    reads config.json only and leaves the embedding and LM head on the meta device, for a caller that puts in
    tensors it already holds."""
    folder = Path(folder)
    config = text_config(read_config(folder, "a target is a Hugging Face model folder"))
    tensors = read_text_tensors(folder, (EMBED, NORM, LM_HEAD)) if weights else {}
    missing = [name for name in (EMBED, NORM) if weights and name not in tensors]
    if missing:
        raise ValueError(f"{folder}: no tensor {missing[0]} in its *.safetensors files, nor under the prefixes of a "
                         f"multimodal checkpoint ({', '.join(prefix for prefix, _ in TEXT_PREFIXES)})")
    rope_theta, rope_scaling = rope_settings(config)
    tie = config.get("tie_word_embeddings", False) or (weights and LM_HEAD not in tensors)
    parts = TargetParts(
        LayerConfig.from_hf(config),
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        model_type=config.get("model_type", ""),
        tie_word_embeddings=tie,
        fingerprint=fingerprint,
        device=None if weights else "meta",
    )
    if not weights:
        return parts
    ours = {EMBED: parts.embed.weight, NORM: parts.norm.weight}
    if not tie:
        ours[LM_HEAD] = parts.lm_head.weight
    with torch.no_grad():
        for name, param in ours.items():
            if tensors[name].shape != param.shape:
                raise ValueError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}, "
                                 f"config.json implies {tuple(param.shape)}")
            param.copy_(tensors[name])
        parts.norm.weight += NORM_OFFSETS.get(config.get("model_type"), 0.0)
    return parts.to(device=device, dtype=dtype)


def read_text_tensors(folder, names) -> dict:
    """The causal LM's tensors `names` from `folder`, whichever of TEXT_PREFIXES' names the checkpoint gives them
    (the first found); a name found under none is left out."""
    candidates = {name: checkpoint_names(name) for name in names}
    held = read_tensors(folder, [found for options in candidates.values() for found in options])
    return {name: next(held[found] for found in options if found in held)
            for name, options in candidates.items() if any(found in held for found in options)}
