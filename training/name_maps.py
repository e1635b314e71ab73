"""This project's head tensors under the names of other engines' and repositories' files: one explicit name map
per layout (training/formats.py says which format uses which), read in both directions: `draftheads export`
writes a head's tensors under their names (to_theirs), `draftheads import` reads theirs back (to_ours). `{}` in a
name is an index (a Medusa head, a block), the same in both names; `{num_layers}` is the head config's field. A tuple
of their names is one tensor of ours, concatenated along dim 0 (our decoder layer fuses q/k/v and gate/up).
EAGLE-3's, DFlash's and DSpark's draft vocabularies are d2t and t2d, as vLLM and speculators store them.
"""
from __future__ import annotations

import re
from dataclasses import asdict

import torch

Names = dict[str, "str | tuple[str, ...]"]  # our state_dict name -> theirs (a tuple: split along dim 0)

LLAMA_LAYER: Names = {
    "qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o.weight": "self_attn.o_proj.weight",
    "o.bias": "self_attn.o_proj.bias",  # only as output_bias_for writes it: our layers' o has no bias
    "post_norm.weight": "post_attention_layernorm.weight",
    "gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down.weight": "mlp.down_proj.weight",
}


def _under(ours: str, theirs: str, names: Names) -> Names:
    return {ours + k: tuple(theirs + x for x in v) if isinstance(v, tuple) else theirs + v for k, v in names.items()}


EAGLE: Names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", **_under("layer.", "layers.0.", LLAMA_LAYER)}
EAGLE31_NORMS: Names = {"fc_input_norm.weight": "input_norm.weight", "fc_norm.{}.weight": "fc_norm.{}.weight"}


def _eagle3(layer: str) -> Names:
    """EAGLE-3's names with its decoder layer under `layer` (midlayer. or layers.0.)."""
    return {"fc.weight": "fc.weight", **EAGLE31_NORMS, "input_norm.weight": f"{layer}input_layernorm.weight",
            "hidden_norm.weight": f"{layer}hidden_norm.weight", **_under("layer.", layer, LLAMA_LAYER),
            "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d",
            "embed_tokens.weight": "embed_tokens.weight"}  # a head's own embedding (own_embedding)


EAGLE3 = _eagle3("midlayer.")
EAGLE_SPECULATORS: Names = {"fc.weight": "fusion_fc.weight", "fc.bias": "fusion_fc.bias",
                             **_under("layer.", "transformer.", LLAMA_LAYER)}
EAGLE3_SPECULATORS = _eagle3("layers.0.")
QWEN3_LAYER: Names = {**LLAMA_LAYER, "input_norm.weight": "input_layernorm.weight",
                      "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight"}
DFLASH: Names = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
                 **_under("layers.{}.", "layers.{}.", QWEN3_LAYER), "token_map": "token_map"}  # the map: from d2t
DSPARK: Names = {**DFLASH, "markov_w1.weight": "markov_head.markov_w1.weight",
                 "markov_w2.weight": "markov_head.markov_w2.weight", "confidence.weight": "confidence_head.proj.weight",
                 "confidence.bias": "confidence_head.proj.bias"}
PEAGLE_SPECULATORS: Names = {**EAGLE3_SPECULATORS, "mask_hidden": "mask_hidden"}
MEDUSA_VLLM: Names = {
    "heads.{}.{}.linear.weight": "blocks.{}.layers.{}.weight", "heads.{}.{}.linear.bias": "blocks.{}.layers.{}.bias",
    "lm_heads.{}.weight": "lm_heads.{}.weight", "token_map": "token_map",
}
MEDUSA_REPO: Names = {
    "heads.{}.{}.linear.weight": "medusa_head.{}.{}.linear.weight",
    "heads.{}.{}.linear.bias": "medusa_head.{}.{}.linear.bias",
    "lm_heads.{}.weight": "medusa_head.{}.{num_layers}.weight",
}
EMBED = "embed_tokens.weight"  # the target's embedding, which EAGLE checkpoints may carry
LM_HEAD = "lm_head.weight"  # the target's LM head (its draft vocabulary's rows), which speculators' DFlash carries
DRAFT_VOCAB = ("d2t", "t2d")  # a draft vocabulary: d2t[draft id] = target id - draft id; t2d marks the target ids


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(r"\{\}", r"(\d+)"))


def their_names(names: Names, ours: str, config) -> tuple[str, ...]:
    """Their names of our tensor `ours` under the map `names` (one, or the pieces of a fused tensor)."""
    for pattern, theirs in names.items():
        match = _pattern(pattern).fullmatch(ours)
        if match:
            indices = match.groups()
            fields = asdict(config)
            return tuple(name.format(*indices, **fields) for name in (theirs if isinstance(theirs, tuple) else (theirs,)))
    raise KeyError(ours)


def piece_sizes(config, ours: str) -> list[int]:
    """The dim-0 sizes of the pieces our fused tensor `ours` splits into."""
    module = ours.split(".")[-2]
    if module == "qkv":
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return [q, kv, kv]
    if module == "gate_up":
        return [config.intermediate_size] * 2
    raise KeyError(ours)


def to_theirs(names: Names, config, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors under their names; fused ones split."""
    theirs = {}
    for name, tensor in ours.items():
        pieces = their_names(names, name, config)
        parts = tensor.split(piece_sizes(config, name)) if len(pieces) > 1 else (tensor,)
        theirs.update(zip(pieces, parts, strict=True))
    return theirs


def to_ours(names: Names, config, theirs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
            where: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Our tensors `expected` (name -> a tensor of the shape and dtype wanted) read from `theirs`, and the names of
    theirs that were read. A missing or misshapen tensor is a ValueError naming it, its expected and its shape."""
    ours, used = {}, set()
    for name, like in expected.items():
        pieces = their_names(names, name, config)
        sizes = piece_sizes(config, name) if len(pieces) > 1 else [like.shape[0] if like.ndim else 0]
        read = []
        for piece, size in zip(pieces, sizes, strict=True):
            if piece not in theirs:
                raise ValueError(f"{where} has no tensor {piece}, which this head needs (its {name})")
            shape = (size, *like.shape[1:]) if like.ndim else ()
            if tuple(theirs[piece].shape) != shape:
                raise ValueError(f"{where}: tensor {piece} has shape {tuple(theirs[piece].shape)}, expected {shape} "
                                 "from the target's sizes and the checkpoint's config.json")
            read.append(theirs[piece])
            used.add(piece)
        ours[name] = (torch.cat(read) if len(read) > 1 else read[0]).to(like.dtype)
    return ours, used


OUTPUT_BIAS = "self_attn.o_proj.bias"


def output_bias_for(config, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero o biases for the Llama draft layers of a head whose q/k/v have biases (a Qwen2 target's): transformers',
    vLLM's and SGLang's Llama attention give o_proj a bias whenever config.json's attention_bias is true, and load
    nothing into it where the file has none (vLLM's stays uninitialised memory). This project's layer has none, so
    the file's is zero."""
    if not config.attention_bias:
        return {}
    return {name.removesuffix("weight") + "bias": torch.zeros(tensor.shape[0], dtype=tensor.dtype)
            for name, tensor in ours.items() if name.split(".")[-2:] == ["o", "weight"]}


def without_output_bias(theirs: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Their tensors less the o_proj biases output_bias_for writes (all zero); any other o_proj bias is refused:
    this project's draft layer has none to load it into."""
    kept = {}
    for name, tensor in theirs.items():
        if name.endswith(OUTPUT_BIAS):
            if tensor.any():
                raise ValueError(f"{where}: tensor {name} is not zero, and this project's draft layers have no bias on "
                                 "the attention's output projection (only on q/k/v, with attention_bias)")
            continue
        kept[name] = tensor
    return kept


def draft_vocab_tensors(ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """d2t and t2d of the draft vocabulary `ids` (ascending target ids)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def draft_vocab_ids(theirs: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int,
                    where: str) -> torch.Tensor | None:
    """The target ids of a file's draft vocabulary (from d2t), None for the whole vocabulary. vLLM reads a missing
    d2t as the identity, which only a draft vocabulary as large as the target's makes."""
    if "d2t" not in theirs:
        if draft_vocab_size != vocab_size:
            raise ValueError(f"{where}: draft_vocab_size is {draft_vocab_size}, below the target's vocabulary "
                             f"{vocab_size}, but the file has no d2t tensor saying which token each draft id is: add "
                             "the d2t (and t2d) the head was trained with, or set draft_vocab_size to the vocabulary "
                             "size if it drafts over all of it")
        return None
    d2t = theirs["d2t"]
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"{where}: tensor d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) from "
                         "draft_vocab_size in its config.json")
    return torch.arange(draft_vocab_size) + d2t.to(torch.int64)
