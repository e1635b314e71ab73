"""The checkpoint layouts of other engines and repositories, each one explicit name map from this project's head
tensors to theirs, read in both directions: `draftheads export` writes ours under their names (to_theirs),
`draftheads import` reads theirs back (to_ours). `{}` in a name is an index (a Medusa head, a block), the same in
both names; `{num_layers}` is the head config's field. A tuple of their names is one tensor of ours, concatenated
along dim 0 (our decoder layer fuses q/k/v and gate/up).

    kind    source       architecture             their tensors                                      read from
    eagle   vllm         EagleLlamaForCausalLM    fc.weight (no bias), layers.0.* (no input_layernorm)  vllm llama_eagle.py
            sglang       LlamaForCausalLMEagle    fc.weight, fc.bias, layers.0.*                     sglang llama_eagle.py
            eagle-repo   LlamaForCausalLM         fc.weight, fc.bias (config "bias"), layers.0.*     SafeAILab/EAGLE cnets1.py
    eagle3  vllm, sglang LlamaForCausalLMEagle3   fc.weight, midlayer.* (input_layernorm, hidden_norm), norm.weight,
            eagle-repo                            lm_head.weight, d2t, t2d    vllm llama_eagle3.py, EAGLE cnets.py,
                                                                              SpecForge llama3_eagle.py
    eagle   speculators  EagleSpeculator          fusion_fc.weight/bias (fusion_bias), transformer.*  speculators eagle.py
    eagle3  speculators  Eagle3Speculator         fc.weight, layers.0.* (input_layernorm, hidden_norm),  speculators
                                                  norm.weight, lm_head.weight, d2t, t2d              eagle3, vllm
    eagle3  vllm, speculators (EAGLE 3.1)         input_norm.weight (norm_before_fc), fc_norm.{i}.weight (fc_norm)
    dflash  z-lab        DFlashDraftModel         fc.weight, hidden_norm.weight, layers.{i}.* (Qwen3:     z-lab dflash model.py
                                                  q_norm, k_norm), norm.weight
            speculators  DFlashSpeculator         the same, and the target's embed_tokens.weight and   speculators dflash,
                                                  lm_head.weight                                     vllm qwen3_dflash.py
    peagle  speculators  PEagleSpeculator         eagle3's, mask_hidden [1, 1, num_aux * hidden];    speculators
                                                  config mask_token_id                               peagle, vllm
    medusa  vllm         MedusaModel              blocks.{i}.layers.{j}.weight/bias, lm_heads.{i}.weight,  vllm medusa.py
                                                  token_map
            medusa-repo  (medusa_lm_head.*)       medusa_head.{i}.{j}.linear.weight/bias,            FasterDecoding/Medusa
                                                  medusa_head.{i}.{num_layers}.weight                medusa_model.py

The speculators format (vllm-project/speculators, which vLLM loads natively) keeps the Llama layer's settings in
config.json's `transformer_layer_config` and its own in `speculators_model_type`, `speculators_config` (proposal
methods, verifier) and per-kind fields; import reads it flattened (speculators_config_fields).
Their files may also hold tensors of the target (EAGLE's embed_tokens.weight; vLLM Medusa's one shared LM head,
original_lm_head): an import checks their shapes and leaves them out, since a head reads the target's own.
EAGLE-3's aux layer ids mean the input of layer i in this project, in vLLM and in the EAGLE repository; SGLang's
file names the layer before (it captures the output of the layer it is given). DFlash's target layers likewise: the
speculators format's aux_hidden_state_layer_ids are this project's target_layers, z-lab's dflash_config
target_layer_ids one lower (z-lab reads the output of the layer it names).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

Names = dict[str, "str | tuple[str, ...]"]  # our state_dict name -> theirs (a tuple: split along dim 0)

LLAMA_LAYER: Names = {
    "qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o.weight": "self_attn.o_proj.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down.weight": "mlp.down_proj.weight",
}


def _under(ours: str, theirs: str, names: Names) -> Names:
    return {ours + k: tuple(theirs + x for x in v) if isinstance(v, tuple) else theirs + v for k, v in names.items()}


EAGLE: Names = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", **_under("layer.", "layers.0.", LLAMA_LAYER)}
EAGLE31_NORMS: Names = {"fc_input_norm.weight": "input_norm.weight", "fc_norm.{}.weight": "fc_norm.{}.weight"}
EAGLE3: Names = {
    "fc.weight": "fc.weight", **EAGLE31_NORMS, "input_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight", **_under("layer.", "midlayer.", LLAMA_LAYER),
    "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d",
}
EAGLE_SPECULATORS: Names = {"fc.weight": "fusion_fc.weight", "fc.bias": "fusion_fc.bias",
                             **_under("layer.", "transformer.", LLAMA_LAYER)}
EAGLE3_SPECULATORS: Names = {
    "fc.weight": "fc.weight", **EAGLE31_NORMS, "input_norm.weight": "layers.0.input_layernorm.weight",
    "hidden_norm.weight": "layers.0.hidden_norm.weight", **_under("layer.", "layers.0.", LLAMA_LAYER),
    "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d",
}
QWEN3_LAYER: Names = {**LLAMA_LAYER, "input_norm.weight": "input_layernorm.weight",
                      "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight"}
DFLASH: Names = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
                 **_under("layers.{}.", "layers.{}.", QWEN3_LAYER)}
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
LM_HEAD = "lm_head.weight"  # the target's LM head, which speculators' DFlash checkpoints carry


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


@dataclass(frozen=True)
class Layout:
    """One source's layout of one head kind: its name map, its config.json fields, and the tensors of the target it
    may hold."""
    kind: str
    source: str
    architecture: str | None
    names: Names

    def kind_fields(self, config: dict, where: str) -> dict:
        """Our head config's fields (those of its kind, and intermediate_size) from their config.json."""
        raise NotImplementedError

    def export_config(self, head) -> dict:
        """Their config.json's fields of this kind."""
        return {}

    def exported(self, head) -> dict[str, torch.Tensor]:
        """The head's tensors to write under their names: its state_dict."""
        return head.state_dict()

    def target_tensors(self, config) -> dict[str, tuple[int, ...]]:
        """Their names of tensors of the target a file may hold, with their shapes."""
        return {}

    def check_tensors(self, config: dict, theirs: dict[str, torch.Tensor], where: str) -> None:
        """Refuse, naming the fix, a file whose tensors disagree with its config.json in a way a missing tensor's name
        would not explain."""

    def target_values(self, head) -> dict[str, torch.Tensor]:
        """Tensors of the target the export writes, under their names."""
        return {}


def _num_layers(config: dict, where: str) -> None:
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers is {config['num_hidden_layers']}, but this project's EAGLE heads "
                         "have one decoder layer")


def _intermediate(config: dict) -> dict:
    return {"intermediate_size": config["intermediate_size"]} if "intermediate_size" in config else {}


class EagleLayout(Layout):
    def kind_fields(self, config, where):
        _num_layers(config, where)
        if self.source == "speculators":
            if config.get("layernorms", False):
                raise ValueError(f"{where}: layernorms is true (norms after the embedding, the fusion and before the LM "
                                 "head), which this project's EAGLE-1 head does not have")
            return {"fc_bias": bool(config.get("fusion_bias", False)), **_intermediate(config)}
        fc_bias = {"vllm": False, "sglang": True}.get(self.source, config.get("bias", True))
        return {"fc_bias": fc_bias, **_intermediate(config)}

    def export_config(self, head):
        if self.source == "speculators":
            return {"layernorms": False, "fusion_bias": head.config.fc_bias}
        return {}

    def exported(self, head):
        ours = {name: t for name, t in head.state_dict().items() if name != "token_map"}  # neither engine loads it
        bias = ours.get("fc.bias")
        if self.source == "vllm":
            if bias is not None and bias.any():
                raise ValueError("vLLM's EAGLE-1 layer has no bias on fc, and this head's fc has one: train with "
                                 "--model.init_args.fc_bias false to export for vLLM, or export --format sglang")
            ours.pop("fc.bias", None)
        elif bias is None and self.source == "sglang":  # SGLang's fc always has a bias, random when the file has none
            ours["fc.bias"] = torch.zeros(head.config.hidden_size)
        return ours

    def target_tensors(self, config):
        return {EMBED: (config.vocab_size, config.hidden_size)}


CAPTURES_SORTED = ("vllm", "speculators")  # capture each aux layer once, ascending (vLLM's model runner does)


def sorted_aux(head) -> tuple[list[int], dict[str, torch.Tensor]]:
    """EAGLE-3's aux layer ids ascending and distinct, as vLLM captures them, and the tensors that read them so:
    fc's column blocks reordered, those of a layer named twice added (fc is linear, so the head computes the same),
    and EAGLE 3.1's input norms reordered alike (a norm over a layer named twice cannot be merged: refused)."""
    c = head.config
    layers = sorted(set(c.aux_layers))
    blocks = head.fc.weight.detach().chunk(len(c.aux_layers), dim=1)
    fused = [sum(block for i, block in zip(c.aux_layers, blocks) if i == layer) for layer in layers]
    tensors = {"fc.weight": torch.cat(fused, dim=1)}
    if len(layers) != len(c.aux_layers) and (c.norm_before_fc or c.fc_norm):
        raise ValueError(f"aux layers {list(c.aux_layers)} name a layer twice, and with norm_before_fc or fc_norm its "
                         "norm cannot be merged into one capture as vLLM makes them: train with distinct aux layers")
    order = sorted(range(len(c.aux_layers)), key=lambda i: c.aux_layers[i])
    if c.norm_before_fc:
        norm_blocks = head.fc_input_norm.weight.detach().chunk(len(order))
        tensors["fc_input_norm.weight"] = torch.cat([norm_blocks[i] for i in order])
    if c.fc_norm:
        tensors.update({f"fc_norm.{j}.weight": head.fc_norm[i].weight.detach() for j, i in enumerate(order)})
    return layers, tensors


EAGLE31_FIELDS = ("norm_before_fc", "fc_norm", "norm_output")


class Eagle3Layout(Layout):
    def kind_fields(self, config, where):
        _num_layers(config, where)
        hidden = config.get("target_hidden_size", config.get("hidden_size"))
        if hidden != config.get("hidden_size"):
            raise ValueError(f"{where}: target_hidden_size {hidden} differs from hidden_size {config.get('hidden_size')}: "
                             "this project's EAGLE-3 heads share the target's hidden size")
        if config.get("norm_before_residual", False):
            raise ValueError(f"{where}: norm_before_residual is true, but this project's EAGLE-3 head keeps g, not "
                             "hidden_norm(g), as the layer's residual stream")
        eagle = config.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")) or []
        if self.source == "sglang":
            layers = [i + 1 for i in layers]
        fields = {"aux_layers": tuple(layers), **_intermediate(config)}
        # vLLM reads norm_before_fc from eagle_config first, the others from the config's top level
        fields.update({name: eagle.get(name, config.get(name, False)) if name == "norm_before_fc"
                       else config.get(name, False) for name in EAGLE31_FIELDS})
        if config.get("draft_vocab_size"):
            fields["draft_vocab_size"] = config["draft_vocab_size"]
        return fields

    def exported(self, head):
        c = head.config
        on = [name for name in EAGLE31_FIELDS if getattr(c, name)]
        if on and self.source not in CAPTURES_SORTED:
            raise ValueError(f"this EAGLE-3 head has EAGLE 3.1's {', '.join(on)}, which {self.source}'s EAGLE-3 layer "
                             "does not have: export it --format vllm or --format speculators (vLLM loads both)")
        ours = head.state_dict()
        if self.source in CAPTURES_SORTED:
            ours.update(sorted_aux(head)[1])
        return ours

    def export_config(self, head):
        c = head.config
        norms = {name: getattr(c, name) for name in EAGLE31_FIELDS}
        layers = list(sorted_aux(head)[0] if self.source in CAPTURES_SORTED else c.aux_layers)
        if self.source == "sglang":
            if min(layers) < 1:
                raise ValueError(f"aux layer 0 (the embeddings) cannot be named for SGLang, which captures the "
                                 f"output of the layer it is given: train with aux layers >= 1 (got {layers})")
            layers = [i - 1 for i in layers]
        if self.source == "speculators":
            if len(layers) != len(c.aux_layers):
                raise ValueError(f"aux layers {list(c.aux_layers)} name a layer twice, and the speculators format "
                                 "sizes fc by the distinct layers it captures: export --format vllm (it adds the "
                                 "repeated layer's fc blocks), or train with distinct aux layers")
            return {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
                    "eagle_aux_hidden_state_layer_ids": layers, "norm_before_residual": False, **norms}
        return {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
                "eagle_aux_hidden_state_layer_ids": layers, **(norms if self.source in CAPTURES_SORTED else {}),
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layers}}

    def target_tensors(self, config):
        return {EMBED: (config.vocab_size, config.hidden_size)}


class PeagleLayout(Eagle3Layout):
    """EAGLE-3's speculators layout and P-EAGLE's own: `mask_token_id` and the tensor `mask_hidden` (fc's input, so
    ordered as fc's blocks are), and the depths trained as the greedy proposal's `speculative_tokens` (speculators'
    training writes num_depths there) unless the config names `num_depths`."""

    def kind_fields(self, config, where):
        fields = super().kind_fields(config, where)
        if config.get("mask_token_id") is None:
            raise ValueError(f"{where}: its config.json has no mask_token_id, which a P-EAGLE head needs (the "
                             "token its placeholder rows read)")
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        return {**fields, "mask_token_id": config["mask_token_id"],
                "num_depths": config.get("num_depths", methods[0].get("speculative_tokens", 4))}

    def exported(self, head):
        if head.config.markov_rank:
            raise ValueError(f"this P-EAGLE head has a Markov head (markov_rank={head.config.markov_rank}), which "
                             f"{self.source}'s P-EAGLE format and vLLM do not have: serve it in this engine, or export "
                             "a head trained with markov_rank 0")
        ours = super().exported(head)
        aux = list(head.config.aux_layers)
        order = sorted(range(len(aux)), key=aux.__getitem__)
        ours["mask_hidden"] = head.mask_hidden.detach().view(len(aux), -1)[order].view(head.mask_hidden.shape)
        return ours

    def export_config(self, head):
        return {**super().export_config(head), "mask_token_id": head.config.mask_token_id,
                "num_depths": head.config.num_depths}


class MedusaLayout(Layout):
    def kind_fields(self, config, where):
        if self.source == "medusa-repo":
            return {"num_heads": config["medusa_num_heads"], "num_layers": config.get("medusa_num_layers", 1),
                    "own_lm_head": True}
        if not config.get("medusa_fc_bias", False):
            raise ValueError(f"{where}: medusa_fc_bias is false, but this project's Medusa blocks have biases")
        truncated = config.get("truncated_vocab_size") or config["vocab_size"]
        return {"num_heads": config["num_heads"], "num_layers": config["num_hidden_layers"],
                "own_lm_head": not config.get("original_lm_head", False),
                "token_map_size": truncated if truncated < config["vocab_size"] else 0}

    def export_config(self, head):
        c = head.config
        return {"model_type": "medusa", "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
                "truncated_vocab_size": c.token_map_size or c.vocab_size, "medusa_fc_bias": True,
                "original_lm_head": not c.own_lm_head}

    def exported(self, head):
        c = head.config
        if self.source == "vllm" and c.own_lm_head and c.token_map_size:
            # vLLM sizes each own LM head by the whole vocabulary and cuts a file's rows down to the map's before
            # loading them, so neither the map's rows nor the whole vocabulary's load (its weight loader asserts
            # the vocabulary size); rows outside the map cannot be made to lose the argmax either.
            raise ValueError(f"this Medusa head has its own LM heads over a token map of {c.token_map_size} tokens, "
                             "which vLLM cannot load (it loads own LM heads only over the whole vocabulary): train "
                             "it with --model.init_args.own_lm_head false (vLLM reads the target's LM head over the "
                             "map) or without --model.init_args.token_map")
        return head.state_dict()

    def target_tensors(self, config):
        if self.source == "vllm" and not config.own_lm_head:  # vLLM reads the shared LM head from the file
            return {"lm_heads.0.weight": (config.token_map_size or config.vocab_size, config.hidden_size)}
        return {}

    def target_values(self, head):
        if self.source == "vllm" and not head.config.own_lm_head:  # the map's rows when the head has one
            return {"lm_heads.0.weight": head.target.lm_head.weight}
        return {}


class DFlashLayout(Layout):
    """z-lab's layout (a Qwen3 config with `dflash_config`; the target's embedding and LM head borrowed) or the
    speculators format (the same tensors and the target's embedding and LM head, over the whole vocabulary here)."""

    def kind_fields(self, config, where):
        if self.source == "speculators":
            if config.get("sample_from_anchor", False):
                raise ValueError(f"{where}: sample_from_anchor is true (DSpark's slot 0 drafts too), but this project's "
                                 "DFlash drafts from the mask slots only")
            if config.get("draft_vocab_size", config["vocab_size"]) != config["vocab_size"]:
                raise ValueError(f"{where}: draft_vocab_size {config['draft_vocab_size']} is not the vocabulary "
                                 f"{config['vocab_size']}: this project's DFlash drafts over the target's LM head")
            layers, causal = config["aux_hidden_state_layer_ids"], False
        else:
            dflash = config.get("dflash_config") or {}
            layers = [i + 1 for i in dflash["target_layer_ids"]]
            causal = bool(config.get("is_causal", False))
        dflash = config.get("dflash_config") or {}
        return {"num_layers": config["num_hidden_layers"], "target_layers": tuple(layers),
                "block_size": config.get("block_size") or dflash.get("block_size"),
                "mask_token_id": config.get("mask_token_id", dflash.get("mask_token_id")), "causal": causal,
                **_intermediate(config)}

    def check_tensors(self, config, theirs, where):
        held = sorted({int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").match, theirs) if m})
        if held != list(range(config["num_hidden_layers"])):
            raise ValueError(f"{where}: config.json counts num_hidden_layers {config['num_hidden_layers']} but its weights "
                             f"hold layers {held[0] if held else '-'}..{held[-1] if held else '-'}: the weights are "
                             "incomplete (download every file), or num_hidden_layers is wrong")

    def exported(self, head):
        if head.token_map is not None:
            raise ValueError(f"this DFlash head drafts among the {len(head.token_map)} tokens of a token map, which the "
                             f"{self.source} layout cannot name: train it without --model.init_args.token_map to export it")
        if self.source == "speculators" and head.config.causal:
            raise ValueError("this DFlash head's blocks are causal, and the speculators format (vLLM) attends within a "
                             "block bidirectionally on full-attention layers: export it --format z-lab (is_causal), or "
                             "train with causal false")
        if self.source == "z-lab" and min(head.config.target_layers) < 1:
            raise ValueError(f"target layer 0 (the embeddings) cannot be named in z-lab's layout, which reads the output "
                             f"of the layer it names: train with target layers >= 1 (got {list(head.config.target_layers)})")
        return head.state_dict()

    def export_config(self, head):
        c = head.config
        if self.source == "speculators":
            return {"draft_vocab_size": c.vocab_size, "target_hidden_size": c.hidden_size, "block_size": c.block_size,
                    "aux_hidden_state_layer_ids": list(c.target_layers), "mask_token_id": c.mask_token_id,
                    "sample_from_anchor": False}
        return {"block_size": c.block_size, "num_target_layers": c.num_target_layers, "is_causal": c.causal,
                "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.target_layers],
                                  "block_size": c.block_size}}

    def target_tensors(self, config):
        if self.source == "speculators":
            return {EMBED: (config.vocab_size, config.hidden_size), LM_HEAD: (config.vocab_size, config.hidden_size)}
        return {}

    def target_values(self, head):
        if self.source == "speculators":  # its files are self-contained: vLLM reads the drafter's own
            return {EMBED: head.target.embed.weight, LM_HEAD: head.target.lm_head.weight}
        return {}


SPECULATORS_KINDS = {"eagle": "eagle", "eagle3": "eagle3", "peagle": "peagle", "dflash": "dflash"}  # speculators_model_type -> our kind
SPECULATORS_ARCHITECTURES = {"eagle": "EagleSpeculator", "eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator",
                             "dflash": "DFlashSpeculator"}


def speculators_config(kind: str, layer_config: dict, kind_fields: dict, verifier: dict,
                       num_speculative_tokens: int) -> dict:
    """config.json of the speculators format: the Llama layer's settings nested, the kind's own fields beside them,
    the greedy proposal of `num_speculative_tokens` and the verifier (`name_or_path`, `architectures`), which
    vLLM serves when given the export as its model."""
    return {"speculators_model_type": kind, "architectures": [SPECULATORS_ARCHITECTURES[kind]],
            "transformer_layer_config": layer_config, **kind_fields,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": num_speculative_tokens}],
                                   "verifier": verifier}}


def speculators_config_fields(config: dict) -> dict:
    """A speculators config.json flattened as the other layouts' are: the Llama layer's settings beside the kind's."""
    return {**config["transformer_layer_config"],
            **{key: value for key, value in config.items() if key != "transformer_layer_config"}}


LAYOUTS: dict[tuple[str, str], Layout] = {
    ("eagle", "vllm"): EagleLayout("eagle", "vllm", "EagleLlamaForCausalLM", EAGLE),
    ("eagle", "sglang"): EagleLayout("eagle", "sglang", "LlamaForCausalLMEagle", EAGLE),
    ("eagle", "eagle-repo"): EagleLayout("eagle", "eagle-repo", "LlamaForCausalLM", EAGLE),
    ("eagle3", "vllm"): Eagle3Layout("eagle3", "vllm", "LlamaForCausalLMEagle3", EAGLE3),
    ("eagle3", "sglang"): Eagle3Layout("eagle3", "sglang", "LlamaForCausalLMEagle3", EAGLE3),
    ("eagle3", "eagle-repo"): Eagle3Layout("eagle3", "eagle-repo", "LlamaForCausalLMEagle3", EAGLE3),
    ("eagle", "speculators"): EagleLayout("eagle", "speculators", "EagleSpeculator", EAGLE_SPECULATORS),
    ("eagle3", "speculators"): Eagle3Layout("eagle3", "speculators", "Eagle3Speculator", EAGLE3_SPECULATORS),
    ("dflash", "z-lab"): DFlashLayout("dflash", "z-lab", "DFlashDraftModel", DFLASH),
    ("dflash", "speculators"): DFlashLayout("dflash", "speculators", "DFlashSpeculator", DFLASH),
    ("peagle", "speculators"): PeagleLayout("peagle", "speculators", "PEagleSpeculator", PEAGLE_SPECULATORS),
    ("medusa", "vllm"): MedusaLayout("medusa", "vllm", "MedusaModel", MEDUSA_VLLM),
    ("medusa", "medusa-repo"): MedusaLayout("medusa", "medusa-repo", None, MEDUSA_REPO),
}
SOURCES = tuple(dict.fromkeys(source for _, source in LAYOUTS))
