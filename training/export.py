"""`draftheads export`: a head folder in the layout vLLM or SGLang loads as a draft model, through the name maps of
training/formats.py (which `draftheads import` reads the other way); the kind x format table at the end of
--help is made from them.

EAGLE 3.1's norms (norm_before_fc, fc_norm, norm_output) go to vLLM and speculators under those names, with their
tensors input_norm.weight and fc_norm.{i}.weight (vLLM 0.32 loads them); SGLang's EAGLE-3 layer has none, so a head
with one is refused there.

The speculators format (vllm-project/speculators) names the verifier, the target folder (--target), so vLLM serves
an EAGLE-3 export given as its model: `vllm serve OUT`, draft length from --num-speculative-tokens (its
--speculative-config may override it). vLLM's EAGLE-1 layer has no fc bias and silently drops one it is given, so
an EAGLE-1 head with a bias is refused for vLLM (SGLang and speculators keep it). vLLM captures each EAGLE-3 aux
layer once, in ascending order: the export orders fc's blocks so (adding those of a layer named twice). Every
export records what wrote it (config.json's "draftheads": version, kind, format), so `draftheads import` reads
it back without --from. The decoder layer's fused projections are split back into q/k/v_proj and gate/up_proj. The
engines share the target's embedding and (EAGLE-1) LM head with the draft, but vLLM embeds an EAGLE-3 or P-EAGLE
draft's tokens with the file's embedding where it differs from the target's: a head with an embedding of its own
(embed_requires_grad) goes out with it to vllm and speculators, and is refused for SGLang. A speculators EAGLE-3 or
P-EAGLE export always carries embed_tokens.weight (the target's for a head without its own), as speculators writes it. EAGLE-3's aux layer ids mean the
input of layer i in this project and in vLLM; SGLang captures the output of layer i, so its file says i - 1.
A Medusa head sharing the target's LM head over a token map keeps it (vLLM's `token_map` tensor and
truncated_vocab_size); one with its own LM heads over a map, which vLLM cannot load, goes out with each LM head over
the whole vocabulary, every unmapped row the mean of the mapped rows (its logit the mean of theirs, so it never wins
the argmax). A DFlash head over a token map goes out as the draft vocabulary vLLM's DFlash reads (draft_vocab_size,
d2t, t2d and the map's rows as lm_head.weight; vLLM scatters the draft logits with -inf elsewhere). An EAGLE-1
head drafts over the whole vocabulary once exported, unless SGLang is given the map's file
(--speculative-token-map). Neither engine loads MTP modules for a Llama-family target (they read them only
inside DeepSeek-V3-style checkpoints), and SGLang has no Medusa: those exports are refused. Serve the result with:

    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": OUT, "num_speculative_tokens": 4}'
    vllm serve OUT          (--format speculators: the target is the verifier its config.json names)
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT
    vllm serve TARGET --speculative-config '{"method": "dflash", "model": OUT, "num_speculative_tokens": B - 1}'

A DFlash export drafts block_size - 1 tokens (its speculators proposal says so); a causal one is refused for the
speculators format, whose full-attention layers attend within a block bidirectionally (z-lab's is_causal keeps it).
A DSpark export (speculators' DSparkSpeculator, or vLLM's Qwen3DSparkModel with --format vllm) drafts block_size
tokens, or block_size - 1 with sample_from_anchor false; vLLM serves it with "method": "dspark" on GPUs (its V2
model runner, which needs Triton; its CPU build refuses the method).
"""
from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import heads
from heads.checkpoint import write_folder
from heads.token_map import lm_head_rows
from training.cli import DocHelpFormatter
from training.formats import CONVERTERS, LAYOUTS, table
from training.name_maps import output_bias_for, to_theirs

FORMATS = tuple(name for name, converter in CONVERTERS.items() if converter.writes)
WRITER = "draftheads"  # config.json's key naming what wrote an export


def add_arguments(parser) -> None:
    parser.description, parser.formatter_class = f"{__doc__}\nkind x format:\n\n{table()}\n", DocHelpFormatter
    parser.add_argument("head", help="a head folder (runs/<kind>/heads/best)")
    parser.add_argument("--format", choices=FORMATS, required=True, help="the engine that loads the export")
    parser.add_argument("--out", required=True, help="folder to write config.json and model.safetensors to")
    parser.add_argument("--target", default=None,
                        help="the head's target, read for a Medusa head sharing its LM head and named as the verifier "
                             "of a speculators export (default: the built-in one)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="speculators format: the draft length its config proposes (default: 4)")


def run(args) -> int:
    from serving import targets

    head = heads.load(args.head)
    verifier = None
    layout = LAYOUTS.get((head.config.kind, args.format))
    if layout is not None and layout.needs_target(head):
        folder = targets.resolve(args.target or targets.DEFAULT_TARGET)
        parts = heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))
        if head.token_map is not None:
            parts.lm_head = lm_head_rows(parts.lm_head, head.token_map)
        head.bind_target(parts)
    if CONVERTERS[args.format].nested:  # it names its verifier
        verifier = targets.resolve(args.target or targets.DEFAULT_TARGET)
    out = export(head, args.format, args.out, verifier=verifier, num_speculative_tokens=args.num_speculative_tokens)
    print(f"wrote the {head.config.kind} head as a {args.format} draft model to {out}")
    if args.format in ("vllm", "speculators"):
        note = vllm_window_note(head, args.target or targets.DEFAULT_TARGET)
        if note:
            print(f"note: {note}")
    if head.config.kind == "eagle" and head.token_map is not None:
        print(f"it was trained to draft among the {len(head.token_map)} tokens of a token map: SGLang drafts among "
              "them given that file (--speculative-token-map), vLLM over the whole vocabulary")
    return 0


def vllm_window_note(head, target: str) -> str | None:
    """What vLLM does with the head's draft layer on a target (a name or folder) whose every layer has one sliding
    window (Mistral's): where the layer's config.json names no window of its own, vLLM's attention takes the cache
    config's, the target's, so the layer drafts as in this engine only with that draft_window. None where nothing
    differs, or the head has no draft layer of that kind (the target is then not read)."""
    from serving import targets
    from serving.model import layer_windows

    if head.config.kind not in ("eagle", "eagle3", "peagle"):
        return None
    windows = set(layer_windows(json.loads((Path(targets.resolve(target)) / "config.json").read_text())))
    if len(windows) != 1 or not (window := windows.pop()) or head.config.draft_window == window:
        return None
    return (f"every layer of the target attends through a sliding window of {window} keys, and vLLM runs this head's "
            f"draft layer with that window too (draft_window {head.config.draft_window} here): it accepts as in "
            f"this engine only up to {window}-token contexts; train with --model.init_args.draft_window {window} "
            "to draft alike at any length")


def export(head, engine: str, out, *, verifier=None, num_speculative_tokens: int = 4):
    """Write `head` to folder `out` for `engine`: its own tensors, and the target's where the layout carries them
    (the head bound to its target then). The speculators
    format names `verifier`, the target's folder (or hub id), and proposes `num_speculative_tokens` drafts."""
    kind = head.config.kind
    if engine not in FORMATS:
        raise ValueError(f"format {engine!r} is unknown: choose one of {', '.join(FORMATS)}")
    if (kind, engine) not in LAYOUTS:
        why = {"mtp": "neither vLLM nor SGLang loads MTP modules for a Llama-family target (they read them only from "
                      "DeepSeek-V3-style checkpoints): serve it with `draftheads bench`",
               "medusa": "SGLang and the speculators format have no Medusa drafter: export it --format vllm",
               "dflash": "vLLM and SGLang load DFlash drafters in z-lab's layout: export it --format z-lab (or "
                         "--format speculators, which vLLM also serves)",
               "dspark": "vLLM serves DSpark from the speculators format or its own Qwen3DSparkModel config: "
                         "export it --format speculators or --format vllm",
               "peagle": "vLLM serves P-EAGLE from the speculators format (EAGLE-3 with parallel drafting): export "
                         "it --format speculators"}[kind]
        raise ValueError(f"cannot export a {kind} head for {engine}: {why}")
    if head.config.qk_norm and kind in ("eagle", "eagle3", "peagle"):  # Medusa has no layer; DFlash's are Qwen3's
        raise ValueError(f"this {kind} head has q/k norms (a Qwen3 target): the {engine} Llama draft layers have none")
    layout = LAYOUTS[kind, engine]
    block = kind in ("dflash", "dspark")
    ours = layout.exported(head)
    if not block:
        ours.update(output_bias_for(head.config, ours))
    tensors = {**to_theirs(layout.names, head.config, ours), **layout.target_values(head)}
    layer = qwen3_config(head.config) if block else {**llama_config(head.config), **layout.layer_window(head)}
    drafts = head.config.num_drafts if block else num_speculative_tokens
    config = layout.format.write_config(kind, layer, layout.export_config(head),
                                        None if verifier is None else verifier_of(verifier), drafts)
    config[WRITER] = {"version": importlib.metadata.version("draftheads"), "kind": kind, "format": engine}
    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in tensors.items()}
    return write_folder(out, config, tensors, {"format": "pt"})


def verifier_of(target) -> dict:
    """The speculators config's verifier: the target's name or folder, and its architectures when a folder."""
    config = Path(target) / "config.json"
    architectures = json.loads(config.read_text()).get("architectures", []) if config.is_file() else []
    return {"name_or_path": str(target), "architectures": architectures}


def llama_config(c) -> dict:
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "attention_bias": c.attention_bias, "tie_word_embeddings": False, "torch_dtype": "float32"}


def qwen3_config(c) -> dict:
    """DFlash's layers: Qwen3's (q/k norm), as many as the head has."""
    return {**llama_config(c), "model_type": "qwen3", "num_hidden_layers": c.num_layers, "attention_bias": False}
