"""The checkpoint layouts of other engines and repositories: one converter per external format (`Format`), which
holds what sets that format apart as data (how it numbers captured layers, whether its engine captures them sorted,
which optional norms its layers have, whether its config.json nests the layer's settings) and, per head kind it
has, a `Layout`: the architecture it names, one explicit name map from this project's head tensors to its own, and
the kind's per-format settings (fc bias, config.json keys, tensors of the target it carries). `draftheads export`
writes a head under their names, `draftheads import` reads theirs back (the maps and their reading:
training/name_maps.py); `table()` renders the kind x format matrix from this data.

Sources the maps were read from: vLLM's llama_eagle.py, llama_eagle3.py, medusa.py, qwen3_dflash.py and qwen3_dspark.py (with its speculators config converter); SGLang's
llama_eagle.py and llama_eagle3.py; SafeAILab/EAGLE's cnets1.py and cnets.py (and SpecForge's llama3_eagle.py);
speculators' eagle, eagle3, peagle, dflash and dspark models (which vLLM loads natively); FasterDecoding/Medusa's
medusa_model.py; z-lab's dflash model.py.

A captured layer's id means the input of layer i in this project, in vLLM, in speculators and in the EAGLE
repository; SGLang's EAGLE-3 files and z-lab's DFlash files name the layer before (they capture the output of the
layer they name): their layer_offset is -1. Files may also hold tensors of the target (EAGLE's embed_tokens.weight;
vLLM Medusa's one shared LM head; speculators DFlash's embedding and LM head): an import checks their shapes and
leaves them out, since a head reads the target's own. An EAGLE-3 or P-EAGLE file's embed_tokens.weight is the
exception where vLLM reads it (vLLM's and speculators' layouts): vLLM embeds the draft's tokens with the file's
embedding unless it equals the target's, so one that differs (speculators trains P-EAGLE's by default,
embed_requires_grad) is imported as the head's own embedding, and a head with its own goes out with it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from training.name_maps import (
    DFLASH, DRAFT_VOCAB, DSPARK, EAGLE, EAGLE3, EAGLE3_SPECULATORS, EAGLE_SPECULATORS, EMBED, LM_HEAD, MEDUSA_REPO, MEDUSA_VLLM,
    PEAGLE_SPECULATORS, Names, draft_vocab_ids, draft_vocab_tensors,
)

def _num_layers(config: dict, where: str) -> None:
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers is {config['num_hidden_layers']}, but this project's EAGLE heads "
                         "have one decoder layer: only a one-layer head imports (speculators' trainer: --num-layers 1)")


def _intermediate(config: dict) -> dict:
    return {"intermediate_size": config["intermediate_size"]} if "intermediate_size" in config else {}


def _path(config: dict, key: str, default=None):
    """config.json's value at `key`, a dotted path into nested objects ("dflash_config.block_size")."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return default
        value = value[part]
    return value


@dataclass(frozen=True)
class Format:
    """One external format, the converter for every head kind it has: its differences from this project as data,
    and its `layouts` by kind."""
    name: str
    layouts: dict[str, "Layout"]
    layer_offset: int = 0  # its id of a captured target layer is ours + layer_offset (-1: the output of the one before)
    captures_sorted: bool = False  # its engine captures each EAGLE-3 aux layer once, ascending (vLLM's model runner)
    eagle3_norms: tuple[str, ...] = ()  # the optional EAGLE-3 norms its layer has (EAGLE 3.1's, norm_before_residual)
    nested: bool = False  # config.json keeps the layer's settings in transformer_layer_config (speculators)
    writes: bool = True  # `draftheads export` writes it (the repositories' own layouts are read only)

    def __post_init__(self):
        for kind, layout in self.layouts.items():
            object.__setattr__(layout, "kind", kind)
            object.__setattr__(layout, "format", self)

    def write_config(self, kind: str, layer: dict, kind_fields: dict, verifier: dict | None,
                     num_speculative_tokens: int) -> dict:
        """Its config.json of a `kind` head: the layer's settings `layer`, the kind's `kind_fields`. The nested
        format (speculators) keeps the layer's settings apart, names its kind (speculators_model_type), the greedy
        proposal of `num_speculative_tokens` and the verifier (`name_or_path`, `architectures`; required), which
        vLLM serves when given the export as its model."""
        architectures = [self.layouts[kind].architecture]
        if not self.nested:
            return {**layer, "architectures": architectures, **kind_fields}
        if verifier is None:
            raise ValueError(f"a {self.name} export names its verifier: give the target's folder or hub id")
        return {"speculators_model_type": kind, "architectures": architectures, "transformer_layer_config": layer,
                **kind_fields,
                "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy",
                                                             "speculative_tokens": num_speculative_tokens}],
                                       "verifier": verifier}}

    def flat_config(self, config: dict) -> dict:
        """Its config.json flattened as the other formats' are: the layer's settings beside the kind's."""
        if not self.nested:
            return config
        return {**config["transformer_layer_config"],
                **{key: value for key, value in config.items() if key != "transformer_layer_config"}}


@dataclass(frozen=True)
class Layout:
    """One format's layout of one head kind: its architecture and name map; subclasses add the kind's settings.
    `kind` and `format` are filled in by the Format that holds it."""
    architecture: str | None
    names: Names
    # its draft layer runs with a sliding window where config.json's layer_types says sliding_attention, of
    # sliding_window keys (vLLM's Llama attention reads them so in its EAGLE-3 drafter, speculators' trainer too)
    draft_window: bool = False
    kind: str = field(default="", init=False)
    format: Format = field(default=None, init=False, repr=False, compare=False)

    @property
    def source(self) -> str:
        return self.format.name

    def kind_fields(self, config: dict, where: str) -> dict:
        """Our head config's fields (those of its kind, and intermediate_size) from their flat config.json."""
        raise NotImplementedError

    def window_fields(self, config: dict, where: str) -> dict:
        """draft_window from their flat config.json's layer_types and sliding_window (none: full attention)."""
        types = config.get("layer_types") or []
        if "sliding_attention" not in types:
            return {}
        if not self.draft_window:
            raise ValueError(f"{where}: its layer_types asks for a sliding window, which the {self.source} {self.kind} "
                             "layer does not run: import it --from vllm or speculators (EAGLE-3, P-EAGLE)")
        if set(types) != {"sliding_attention"} or not config.get("sliding_window"):
            raise ValueError(f"{where}: layer_types {types} with sliding_window {config.get('sliding_window')!r}: "
                             "this project's heads have one draft layer, windowed (sliding_attention with a "
                             "positive sliding_window) or not")
        return {"draft_window": config["sliding_window"]}

    def layer_window(self, head) -> dict:
        """Their config.json's window fields of the head's layer (none for full attention); a windowed head is
        refused where the format's layer has no window."""
        window = head.config.draft_window
        if not window:
            return {}
        if not self.draft_window:
            raise ValueError(f"this {self.kind} head drafts with draft_window={window}, which the {self.source} "
                             f"{self.kind} layer does not run: "
                             + ("vLLM's EAGLE-1 drafter reads layer_types at its layer's id after the target's, out of "
                                "range, so it cannot load it; " if (self.kind, self.source) == ("eagle", "vllm") else "")
                             + "serve it with this engine, export an EAGLE-3 or P-EAGLE head --format vllm or "
                             "speculators, or train with draft_window 0")
        return {"sliding_window": window, "layer_types": ["sliding_attention"]}

    def fill(self, config: dict, head_config, theirs: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        """Their tensors completed with what the format leaves implicit (for the head config `head_config` read
        from config.json), checked against config.json in ways a missing tensor's name would not explain."""
        return theirs

    def check_target(self, theirs: dict[str, torch.Tensor], head, where: str) -> None:
        """Refuse tensors of the target in the file (target_tensors) whose values the bound head would not read."""

    def tensor_fields(self, theirs: dict[str, torch.Tensor], parts, where: str) -> dict:
        """Our head config's fields that their tensors `theirs` decide, against the target's parts `parts`."""
        return {}

    def exported(self, head) -> dict[str, torch.Tensor]:
        """The head's tensors to write under their names: its state_dict."""
        return head.state_dict()

    def export_config(self, head) -> dict:
        """Their config.json's fields of this kind."""
        return {}

    def target_tensors(self, config) -> dict[str, tuple[int, ...]]:
        """Their names of tensors of the target a file may hold, with their shapes."""
        return {}

    def notes(self) -> list[str]:
        """What table() says of this layout: its architecture, whether export writes it, its differences."""
        return [self.architecture or "(no architecture)", "import, export" if self.format.writes else "import"]

    def needs_target(self, head) -> bool:
        """Whether the export writes tensors of the target (target_values), so the head must be bound to it."""
        return False

    def target_values(self, head) -> dict[str, torch.Tensor]:
        """Tensors of the target the export writes, under their names."""
        return {}


@dataclass(frozen=True)
class EagleLayout(Layout):
    """EAGLE-1. `fc_bias`: True, the format's fc always has a bias (zeros written where the head has none); False,
    it has none (a head's non-zero one is refused); a config.json key, the file says (default `fc_bias_default`).
    `absent`: config.json flags of layers this head lacks, refused when true and written false."""
    fc_bias: bool | str = False
    fc_bias_default: bool = False
    absent: dict[str, str] = field(default_factory=dict)

    def notes(self):
        bias = self.fc_bias if isinstance(self.fc_bias, str) else "always" if self.fc_bias else "none"
        return [*super().notes(), f"fc bias: {bias}"]

    def kind_fields(self, config, where):
        _num_layers(config, where)
        for key, what in self.absent.items():
            if config.get(key, False):
                raise ValueError(f"{where}: {key} is true ({what}), which this project's EAGLE-1 head does not have: "
                                 f"only a head trained with {key} false imports")
        fc_bias = bool(config.get(self.fc_bias, self.fc_bias_default)) if isinstance(self.fc_bias, str) else self.fc_bias
        return {"fc_bias": fc_bias, **_intermediate(config)}

    def export_config(self, head):
        written = {key: False for key in self.absent}
        return {**written, self.fc_bias: head.config.fc_bias} if isinstance(self.fc_bias, str) else written

    def exported(self, head):
        ours = {name: t for name, t in head.state_dict().items() if name != "token_map"}  # no engine loads it
        bias = ours.get("fc.bias")
        if self.fc_bias is False:
            if bias is not None and bias.any():
                raise ValueError(f"{self.source}'s EAGLE-1 layer has no bias on fc, and this head's fc has one: train "
                                 "with --model.init_args.fc_bias false to export for it, or export --format sglang")
            ours.pop("fc.bias", None)
        elif self.fc_bias is True and bias is None:  # its fc always has a bias, random when the file has none
            ours["fc.bias"] = torch.zeros(head.config.hidden_size)
        return ours

    def target_tensors(self, config):
        return {EMBED: (config.vocab_size, config.hidden_size)}


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


EAGLE3_NORMS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")  # vLLM's and speculators' has all


@dataclass(frozen=True)
class Eagle3Layout(Layout):
    """EAGLE-3 (and, subclassed, P-EAGLE). `eagle_config`: config.json repeats the aux layers in an eagle_config
    object (the Llama-architecture files); `distinct_aux`: the format sizes fc by the distinct layers it captures, so
    a layer named twice is refused rather than merged; `reads_embedding`: its engine (vLLM) embeds the draft's tokens
    with a file's embed_tokens.weight where it differs from the target's, so such a file imports as a head with its
    own embedding and a head with its own goes out with it (elsewhere the engine reads the target's: a file's is
    checked for shape and left out); `carries_embedding`: its files always hold the embedding, the target's where the
    head has none of its own (speculators: its loader does not always fill a missing one from the verifier)."""
    eagle_config: bool = True
    distinct_aux: bool = False
    reads_embedding: bool = False
    carries_embedding: bool = False

    def notes(self):
        f = self.format
        return [*super().notes(), *([f"layer ids {f.layer_offset:+d}"] if f.layer_offset else []),
                *(["aux layers sorted"] if f.captures_sorted else []), *([", ".join(f.eagle3_norms)] if f.eagle3_norms else []),
                "own embedding: " + ("carried" if self.carries_embedding else "read" if self.reads_embedding else "no")]

    def kind_fields(self, config, where):
        _num_layers(config, where)
        hidden = config.get("target_hidden_size") or config.get("hidden_size")  # null: the layer's (as vLLM reads it)
        if hidden != config.get("hidden_size"):
            raise ValueError(f"{where}: target_hidden_size {hidden} differs from hidden_size {config.get('hidden_size')}: "
                             "this project's EAGLE-3 heads share the target's hidden size (set target_hidden_size to "
                             "null or to hidden_size if the head was trained on this target)")
        eagle = config.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")) or []
        fields = {"aux_layers": tuple(i - self.format.layer_offset for i in layers), **_intermediate(config)}
        # vLLM reads norm_before_fc from eagle_config first, the others from the config's top level
        fields.update({name: bool(eagle.get(name, config.get(name, False))) if name == "norm_before_fc"
                       else bool(config.get(name, False)) for name in EAGLE3_NORMS})
        if config.get("draft_vocab_size"):
            fields["draft_vocab_size"] = config["draft_vocab_size"]
        return fields

    def fill(self, config, head_config, theirs, where):
        """No d2t and t2d: the whole vocabulary (vLLM reads their absence so), when draft_vocab_size says so."""
        vocab = head_config.vocab_size
        ids = draft_vocab_ids(theirs, head_config.draft_vocab_size, vocab, where)
        if ids is None:
            return {**theirs, **draft_vocab_tensors(torch.arange(vocab), vocab)}
        if "t2d" not in theirs and bool((ids >= 0).all() and (ids < vocab).all()):  # vLLM never reads t2d
            return {**theirs, "t2d": draft_vocab_tensors(ids, vocab)["t2d"]}
        return theirs

    def exported(self, head):
        c = head.config
        on = [name for name in EAGLE3_NORMS if getattr(c, name) and name not in self.format.eagle3_norms]
        if on:
            names = ", ".join(on)
            raise ValueError(f"this EAGLE-3 head has EAGLE 3.1's {names}, which {self.source}'s EAGLE-3 layer does not "
                             "have: export it --format vllm or --format speculators (vLLM loads both)"
                             if on != ["norm_before_residual"] else
                             f"this EAGLE-3 head has norm_before_residual (its residual stream is hidden_norm(g)), which "
                             f"{self.source}'s EAGLE-3 layer does not have: export it --format vllm or --format "
                             "speculators (vLLM loads both)")
        if c.own_embedding and not self.reads_embedding:
            raise ValueError(f"this {self.kind} head has an embedding of its own (trained with embed_requires_grad), "
                             f"and {self.source}'s engine embeds the draft's tokens with the target's: export it "
                             "--format vllm or --format speculators (vLLM reads a draft's own embedding)")
        ours = head.state_dict()
        if self.format.captures_sorted:
            ours.update(sorted_aux(head)[1])
        return ours

    def export_config(self, head):
        c = head.config
        layers = list(sorted_aux(head)[0] if self.format.captures_sorted else c.aux_layers)
        offset = self.format.layer_offset
        if min(layers) + offset < 0:
            raise ValueError(f"aux layer 0 (the embeddings) cannot be named for {self.source}, which captures the "
                             f"output of the layer it is given: train with aux layers >= 1 (got {layers})")
        layers = [i + offset for i in layers]
        if self.distinct_aux and len(layers) != len(c.aux_layers):
            raise ValueError(f"aux layers {list(c.aux_layers)} name a layer twice, and the {self.source} format "
                             "sizes fc by the distinct layers it captures: export --format vllm (it adds the "
                             "repeated layer's fc blocks), or train with distinct aux layers")
        norms = {name: getattr(c, name) for name in self.format.eagle3_norms}
        config = {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
                  "eagle_aux_hidden_state_layer_ids": layers, **norms}
        if self.carries_embedding:  # speculators' name for a trained embedding
            config["embed_requires_grad"] = c.own_embedding
        if self.eagle_config:
            config["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layers}
        return config

    def target_tensors(self, config):
        return {EMBED: (config.vocab_size, config.hidden_size)}

    def tensor_fields(self, theirs, parts, where):
        """own_embedding where the engine reads the file's embedding and it is not the target's (as vLLM compares
        them: equal values, here in the file's dtype). A misshapen one is left to the shape check, which names it."""
        embed = theirs.get(EMBED)
        if not self.reads_embedding or embed is None or tuple(embed.shape) != tuple(parts.embed.weight.shape):
            return {}
        target = parts.embed.weight.detach().to("cpu", embed.dtype)
        return {"own_embedding": not torch.equal(embed, target)}

    def needs_target(self, head):
        return self.carries_embedding and not head.config.own_embedding

    def target_values(self, head):
        if self.needs_target(head):
            return {EMBED: head.target.embed.weight}
        return {}


@dataclass(frozen=True)
class PeagleLayout(Eagle3Layout):
    """EAGLE-3's layout and P-EAGLE's own: `mask_token_id` and the tensor `mask_hidden` (fc's input, so ordered as
    fc's blocks are), and the depths trained as the greedy proposal's `speculative_tokens` (speculators' training
    writes num_depths there) unless the config names `num_depths`."""

    def kind_fields(self, config, where):
        fields = super().kind_fields(config, where)
        if config.get("mask_token_id") is None:
            raise ValueError(f"{where}: its config.json has no mask_token_id, which a P-EAGLE head needs (the "
                             "token its placeholder rows read): set it to the id the head was trained with "
                             "(speculators' trainer takes the tokenizer's mask token, else its pad or eos token)")
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


def never_winning_rows(rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An LM head over the whole vocabulary that drafts what `rows` (the LM head over the token ids `ids`) drafts:
    row ids[i] is rows[i], every other row the mean of `rows`. An unmapped token's logit is then the mean of the
    mapped tokens' logits, below their largest unless all of them are equal, so it never wins the argmax."""
    full = rows.mean(0, keepdim=True).expand(vocab_size, -1).clone()
    full[ids] = rows
    return full


@dataclass(frozen=True)
class MedusaLayout(Layout):
    """Medusa. `keys`: config.json's keys of our num_heads and num_layers (with the default of num_layers);
    `reads_map`: the format has vLLM's token map (`token_map`, truncated_vocab_size) and the shared LM head
    (original_lm_head, its rows in the file); without, every head has its own LM head over the whole vocabulary."""
    keys: tuple[str, str] = ("num_heads", "num_hidden_layers")
    num_layers_default: int | None = None
    reads_map: bool = True

    def kind_fields(self, config, where):
        heads, layers = self.keys
        fields = {"num_heads": config[heads], "num_layers": config.get(layers, self.num_layers_default)}
        if not self.reads_map:
            return {**fields, "own_lm_head": True}
        truncated = config.get("truncated_vocab_size") or config["vocab_size"]
        return {**fields, "own_lm_head": not config.get("original_lm_head", False),
                "token_map_size": truncated if truncated < config["vocab_size"] else 0}

    def notes(self):
        if not self.reads_map:
            return [*super().notes(), "own LM heads"]
        return [*super().notes(), "token map: token_map tensor; own LM heads over one: whole-vocabulary rows"]

    def fill(self, config, head_config, theirs, where):
        """Blocks without biases (medusa_fc_bias false) are this project's with zero biases."""
        if not self.reads_map or config.get("medusa_fc_bias", False):
            return theirs
        zeros = {re.sub(r"\.weight$", ".bias", name): torch.zeros(t.shape[0], dtype=t.dtype)
                 for name, t in theirs.items() if re.fullmatch(r"blocks\.\d+\.layers\.\d+\.weight", name)}
        return {**zeros, **theirs}

    def expands(self, c) -> bool:
        """Whether the export writes own LM heads over a token map as LM heads over the whole vocabulary: vLLM sizes
        own LM heads by the whole vocabulary and cuts a file's rows down to the map's before loading them, so it
        loads neither the map's rows nor, with a map, the whole vocabulary's."""
        return c.own_lm_head and bool(c.token_map_size)

    def export_config(self, head):
        c = head.config
        heads, layers = self.keys
        vocab = c.vocab_size if self.expands(c) else c.token_map_size or c.vocab_size
        return {"model_type": "medusa", heads: c.num_heads, layers: c.num_layers, "truncated_vocab_size": vocab,
                "medusa_fc_bias": True, "original_lm_head": not c.own_lm_head}

    def exported(self, head):
        ours = head.state_dict()
        if self.expands(head.config):
            ours = {name: never_winning_rows(t, head.token_map, head.config.vocab_size) if name.startswith("lm_heads.")
                    else t for name, t in ours.items() if name != "token_map"}
        return ours

    def target_tensors(self, config):
        if self.reads_map and not config.own_lm_head:  # vLLM reads the shared LM head from the file
            return {"lm_heads.0.weight": (config.token_map_size or config.vocab_size, config.hidden_size)}
        return {}

    def needs_target(self, head):
        return self.reads_map and not head.config.own_lm_head

    def target_values(self, head):
        if self.needs_target(head):  # the map's rows when the head has one
            return {"lm_heads.0.weight": head.target.lm_head.weight}
        return {}


@dataclass(frozen=True)
class DFlashLayout(Layout):
    """DFlash. `keys`: config.json's keys (dotted paths) of our target_layers, block_size and mask_token_id, each
    tried in order; `causal`: the key of its causal flag, None where blocks attend bidirectionally only;
    `carries_target`: its files hold the target's embedding and LM head (speculators: self-contained);
    `refused`: config.json flags of drafting this head does not do; `written`: config.json keys export adds, each
    our config's attribute. A token map goes out as the draft vocabulary
    both read (draft_vocab_size, d2t, t2d and the map's rows as lm_head.weight): vLLM scatters the draft logits
    into the whole vocabulary with -inf elsewhere, as this head drafts among the map."""
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    causal: str | None = None
    carries_target: bool = False
    refused: dict[str, str] = field(default_factory=dict)
    written: dict[str, str] = field(default_factory=dict)

    def notes(self):
        return [*super().notes(), *([f"layer ids {self.format.layer_offset:+d}"] if self.format.layer_offset else []),
                *(["carries the target's embedding and LM head"] if self.carries_target else []),
                "causal: " + (self.causal or "no"), "token map: as d2t"]

    def _read(self, config: dict, ours: str):
        return next((value for key in self.keys[ours] if (value := _path(config, key)) is not None), None)

    def kind_fields(self, config, where):
        for key, what in self.refused.items():
            if config.get(key, False):
                raise ValueError(f"{where}: {key} is true ({what}), but this project's DFlash drafts from the mask "
                                 f"slots only: only a head trained with {key} false imports")
        vocab = config["vocab_size"]
        draft_vocab = config.get("draft_vocab_size") or vocab
        layers = self._read(config, "target_layers")
        return {"num_layers": config["num_hidden_layers"],
                "target_layers": tuple(i - self.format.layer_offset for i in layers),
                "block_size": self._read(config, "block_size"), "mask_token_id": self._read(config, "mask_token_id"),
                "causal": bool(config.get(self.causal, False)) if self.causal else False,
                "token_map_size": draft_vocab if draft_vocab < vocab else 0, **_intermediate(config)}

    def fill(self, config, head_config, theirs, where):
        held = sorted({int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").match, theirs) if m})
        if held != list(range(config["num_hidden_layers"])):
            raise ValueError(f"{where}: config.json counts num_hidden_layers {config['num_hidden_layers']} but its weights "
                             f"hold layers {held[0] if held else '-'}..{held[-1] if held else '-'}: the weights are "
                             "incomplete (download every file), or num_hidden_layers is wrong")
        vocab = head_config.vocab_size
        ids = draft_vocab_ids(theirs, head_config.token_map_size or vocab, vocab, where)
        rest = {name: t for name, t in theirs.items() if name not in DRAFT_VOCAB}
        return rest if ids is None else {**rest, "token_map": ids}

    def check_target(self, theirs, head, where):
        """The file's LM head (speculators': the target's rows of the draft vocabulary, frozen in its training) must
        be the target's, which this head reads."""
        if LM_HEAD in theirs:
            ours = head.target.lm_head.weight.detach().float().cpu()
            if not torch.allclose(theirs[LM_HEAD].float(), ours, rtol=1e-2, atol=1e-3):
                raise ValueError(f"{where}: its lm_head.weight is not the target's LM head over its draft vocabulary, "
                                 "and this project's DFlash reads the target's: import it for the target it was "
                                 "trained on (its verifier)")

    def exported(self, head):
        if self.causal is None and head.config.causal:
            raise ValueError(f"this DFlash head's blocks are causal, and the {self.source} format (vLLM) attends "
                             "within a block bidirectionally on full-attention layers: export it --format z-lab "
                             "(is_causal), or train with causal false")
        if min(head.config.target_layers) + self.format.layer_offset < 0:
            raise ValueError(f"target layer 0 (the embeddings) cannot be named in {self.source}'s layout, which reads "
                             "the output of the layer it names: train with target layers >= 1 (got "
                             f"{list(head.config.target_layers)})")
        return {name: t for name, t in head.state_dict().items() if name != "token_map"}

    def export_config(self, head):
        c = head.config
        values = {"target_layers": [i + self.format.layer_offset for i in c.target_layers],
                  "block_size": c.block_size, "mask_token_id": c.mask_token_id}
        config: dict = {"draft_vocab_size": c.token_map_size or c.vocab_size,
                        **{key: getattr(c, ours) for key, ours in self.written.items()}}
        for ours, keys in self.keys.items():  # each value under every key it is read from
            for key in keys:
                *parents, last = key.split(".")
                node = config
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[last] = values[ours]
        if self.causal:
            config[self.causal] = c.causal
        return {**config, **{key: False for key in self.refused}}

    def target_tensors(self, config):
        lm_head = {LM_HEAD: (config.token_map_size or config.vocab_size, config.hidden_size)}
        if self.carries_target:
            return {EMBED: (config.vocab_size, config.hidden_size), **lm_head}
        return lm_head if config.token_map_size else {}

    def needs_target(self, head):
        return self.carries_target or head.token_map is not None

    def target_values(self, head):
        values = {EMBED: head.target.embed.weight} if self.carries_target else {}
        if head.token_map is not None:  # the map ascending, as d2t's draft ids are
            order = head.token_map.argsort()
            ids = head.token_map[order]
            return {**values, LM_HEAD: head.target.lm_head.weight[order.to(head.target.lm_head.weight.device)],
                    **draft_vocab_tensors(ids.cpu(), head.config.vocab_size)}
        if self.carries_target:  # vLLM reads the drafter's own
            values[LM_HEAD] = head.target.lm_head.weight
        return values


@dataclass(frozen=True)
class DSparkLayout(DFlashLayout):
    """DSpark: DFlash's layout plus the Markov head (markov_head.markov_w1/markov_w2) and the confidence head
    (confidence_head.proj, with a bias), and their config.json fields as speculators' DSparkSpeculatorConfig names
    them (markov_rank, markov_head_type, sample_from_anchor, enable_confidence_head, confidence_head_with_markov).
    `native`: vLLM's own Qwen3DSparkModel config, which also names the captured layers as target_layer_ids, one
    lower (the layer whose output is read), as vLLM's converter of speculators configs writes them. A draft
    vocabulary's rows of markov_w2 go out ascending, as d2t's draft ids."""
    native: bool = False

    def notes(self):
        return [*super().notes(), "markov_head_type: vanilla"]

    def _read(self, config, ours):
        value = super()._read(config, ours)
        if ours == "target_layers" and value is None and self.native and config.get("target_layer_ids") is not None:
            return [i + 1 for i in config["target_layer_ids"]]
        return value

    def kind_fields(self, config, where):
        head_type, rank = config.get("markov_head_type", "vanilla"), config.get("markov_rank", 256)
        if head_type != "vanilla":
            raise ValueError(f"{where}: markov_head_type is {head_type!r}, but this project's DSpark (and vLLM's) has "
                             "the vanilla first-order Markov head only: train it with markov_head_type vanilla")
        if not rank:
            raise ValueError(f"{where}: markov_rank is 0 (no Markov head): a DFlash drafter, import it with --format "
                             "dflash")
        # a field left out takes speculators' config class default, or vLLM's model's (no confidence head)
        confidence = not self.native
        return {**super().kind_fields(config, where), "markov_rank": rank,
                "sample_from_anchor": bool(config.get("sample_from_anchor", True)),
                "confidence_head": bool(config.get("enable_confidence_head", confidence)),
                "confidence_with_markov": bool(config.get("confidence_head_with_markov", confidence))}

    def exported(self, head):
        tensors = super().exported(head)
        if head.token_map is not None:
            tensors["markov_w2.weight"] = tensors["markov_w2.weight"][head.token_map.argsort()]
        return tensors

    def export_config(self, head):
        c = head.config
        config = {**super().export_config(head), "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
                  "sample_from_anchor": c.sample_from_anchor, "enable_confidence_head": c.confidence_head,
                  "confidence_head_with_markov": c.confidence_with_markov}
        if self.native:
            config.update(target_layer_ids=[i - 1 for i in c.target_layers], dspark_bonus_anchor=not c.sample_from_anchor)
        return config


VLLM = Format("vllm", captures_sorted=True, eagle3_norms=EAGLE3_NORMS, layouts={
    "eagle": EagleLayout("EagleLlamaForCausalLM", EAGLE, fc_bias=False),
    "eagle3": Eagle3Layout("LlamaForCausalLMEagle3", EAGLE3, reads_embedding=True, draft_window=True),
    "medusa": MedusaLayout("MedusaModel", MEDUSA_VLLM),
    "dspark": DSparkLayout("Qwen3DSparkModel", DSPARK, native=True, keys={
        "target_layers": ("eagle_aux_hidden_state_layer_ids",), "block_size": ("block_size",),
        "mask_token_id": ("mask_token_id",)}, written={"target_hidden_size": "hidden_size"}),
})
SGLANG = Format("sglang", layer_offset=-1, layouts={
    "eagle": EagleLayout("LlamaForCausalLMEagle", EAGLE, fc_bias=True),
    "eagle3": Eagle3Layout("LlamaForCausalLMEagle3", EAGLE3),
})
EAGLE_REPO = Format("eagle-repo", writes=False, layouts={
    "eagle": EagleLayout("LlamaForCausalLM", EAGLE, fc_bias="bias", fc_bias_default=True),
    "eagle3": Eagle3Layout("LlamaForCausalLMEagle3", EAGLE3),
})
SPECULATORS = Format("speculators", captures_sorted=True, eagle3_norms=EAGLE3_NORMS, nested=True, layouts={
    "eagle": EagleLayout("EagleSpeculator", EAGLE_SPECULATORS, fc_bias="fusion_bias", absent={
        "layernorms": "norms after the embedding, the fusion and before the LM head"}),
    "eagle3": Eagle3Layout("Eagle3Speculator", EAGLE3_SPECULATORS, eagle_config=False, distinct_aux=True,
                           reads_embedding=True, carries_embedding=True, draft_window=True),
    "peagle": PeagleLayout("PEagleSpeculator", PEAGLE_SPECULATORS, eagle_config=False, distinct_aux=True,
                           reads_embedding=True, carries_embedding=True, draft_window=True),
    "dflash": DFlashLayout("DFlashSpeculator", DFLASH, carries_target=True, keys={
        "target_layers": ("aux_hidden_state_layer_ids",), "block_size": ("block_size",),
        "mask_token_id": ("mask_token_id",)}, refused={"sample_from_anchor": "DSpark's slot 0 drafts too"},
        written={"target_hidden_size": "hidden_size"}),
    "dspark": DSparkLayout("DSparkSpeculator", DSPARK, carries_target=True, keys={
        "target_layers": ("aux_hidden_state_layer_ids",), "block_size": ("block_size",),
        "mask_token_id": ("mask_token_id",)}, written={"target_hidden_size": "hidden_size"}),
})
MEDUSA_REPO = Format("medusa-repo", writes=False, layouts={
    "medusa": MedusaLayout(None, MEDUSA_REPO, keys=("medusa_num_heads", "medusa_num_layers"), num_layers_default=1,
                           reads_map=False),
})
ZLAB = Format("z-lab", layer_offset=-1, layouts={
    "dflash": DFlashLayout("DFlashDraftModel", DFLASH, causal="is_causal", keys={
        "target_layers": ("dflash_config.target_layer_ids",),
        "block_size": ("block_size", "dflash_config.block_size"),
        "mask_token_id": ("mask_token_id", "dflash_config.mask_token_id")},
        written={"num_target_layers": "num_target_layers"}),
})

CONVERTERS = {f.name: f for f in (VLLM, SGLANG, SPECULATORS, EAGLE_REPO, MEDUSA_REPO, ZLAB)}
LAYOUTS: dict[tuple[str, str], Layout] = {(kind, f.name): layout for f in CONVERTERS.values()
                                          for kind, layout in f.layouts.items()}
SOURCES = tuple(CONVERTERS)


def table() -> str:
    """The kind x format matrix as a Markdown table, from the converters' data (each layout's notes)."""
    rows = ["| kind | " + " | ".join(CONVERTERS) + " |", "|---" * (len(CONVERTERS) + 1) + "|"]
    for kind in sorted({kind for kind, _ in LAYOUTS}):
        cells = ["; ".join(f.layouts[kind].notes()) if kind in f.layouts else "-" for f in CONVERTERS.values()]
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
