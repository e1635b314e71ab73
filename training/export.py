"""`draftheads export`: a head folder in the layout vLLM or SGLang loads as a draft model.

    EAGLE-1  vLLM  "EagleLlamaForCausalLM"   fc.weight, layers.0.* (no input_layernorm, no bias on fc)
             SGLang "LlamaForCausalLMEagle"  fc.weight, fc.bias, layers.0.* (no input_layernorm)
    EAGLE-3  both  "LlamaForCausalLMEagle3"  fc.weight, midlayer.* (with hidden_norm), norm, lm_head, d2t, t2d
    Medusa   vLLM  "MedusaModel"             blocks.{i}.layers.{j}.weight/bias, lm_heads.{i}.weight

The decoder layer's fused projections are split back into q/k/v_proj and gate/up_proj. Neither engine reads the
embedding or (EAGLE-1) the LM head from the draft: both share the target's. EAGLE-3's aux layer ids mean the
input of layer i in this project and in vLLM; SGLang captures the output of layer i, so its file says i - 1.
A Medusa head trained over a token map keeps it (vLLM's `token_map` tensor and truncated_vocab_size); an EAGLE-1
head drafts over the whole vocabulary once exported, unless SGLang is given the map's file
(--speculative-token-map). Neither engine loads MTP modules for a Llama-family target (they read them only
inside DeepSeek-V3-style checkpoints), and SGLang has no Medusa: those exports are refused. Serve the result with:

    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": OUT, "num_speculative_tokens": 4}'
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT
"""
from __future__ import annotations

import argparse

import torch

import heads
from heads.checkpoint import write_folder
from heads.token_map import lm_head_rows

FORMATS = ("vllm", "sglang")
ARCHITECTURES = {("eagle", "vllm"): "EagleLlamaForCausalLM", ("eagle", "sglang"): "LlamaForCausalLMEagle",
                 ("eagle3", "vllm"): "LlamaForCausalLMEagle3", ("eagle3", "sglang"): "LlamaForCausalLMEagle3",
                 ("medusa", "vllm"): "MedusaModel"}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def add_arguments(parser) -> None:
    parser.description, parser.formatter_class = __doc__, _HelpFormatter
    parser.add_argument("head", help="a head folder (runs/<kind>/heads/best)")
    parser.add_argument("--format", choices=FORMATS, required=True, help="the engine that loads the export")
    parser.add_argument("--out", required=True, help="folder to write config.json and model.safetensors to")
    parser.add_argument("--target", default=None,
                        help="the head's target, read only for a Medusa head sharing its LM head (default: the built-in one)")


def run(args) -> int:
    from serving import targets

    head = heads.load(args.head)
    if (head.config.kind, args.format) == ("medusa", "vllm") and not head.config.own_lm_head:
        folder = targets.resolve(args.target or targets.DEFAULT_TARGET)
        parts = heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))
        if head.token_map is not None:
            parts.lm_head = lm_head_rows(parts.lm_head, head.token_map)
        head.bind_target(parts)
    out = export(head, args.format, args.out)
    print(f"wrote the {head.config.kind} head as a {args.format} draft model to {out}")
    if head.config.kind == "eagle" and head.token_map is not None:
        print(f"it was trained to draft among the {len(head.token_map)} tokens of a token map: SGLang drafts among "
              "them given that file (--speculative-token-map), vLLM over the whole vocabulary")
    return 0


def export(head, engine: str, out):
    """Write `head` (its own tensors; the target's are not needed) to folder `out` for `engine`."""
    kind = head.config.kind
    if engine not in FORMATS:
        raise ValueError(f"format {engine!r} is unknown: choose one of {', '.join(FORMATS)}")
    if (kind, engine) not in ARCHITECTURES:
        why = ("neither vLLM nor SGLang loads MTP modules for a Llama-family target (they read them only from "
               "DeepSeek-V3-style checkpoints): serve it with `draftheads bench`" if kind == "mtp" else
               "SGLang has no Medusa drafter: export it --format vllm")
        raise ValueError(f"cannot export a {kind} head for {engine}: {why}")
    if head.config.qk_norm:
        raise ValueError(f"this {kind} head has q/k norms (a Qwen3 target): the {engine} Llama draft layers have none")
    tensors = {"eagle": _eagle, "eagle3": _eagle3, "medusa": _medusa}[kind](head, engine)
    config = {**_llama_config(head.config), "architectures": [ARCHITECTURES[kind, engine]], **_kind_config(head, engine)}
    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in tensors.items()}
    return write_folder(out, config, tensors, {"format": "pt"})


def _llama_config(c) -> dict:
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "attention_bias": c.attention_bias, "tie_word_embeddings": False, "torch_dtype": "float32"}


def _kind_config(head, engine: str) -> dict:
    c = head.config
    if c.kind == "medusa":
        return {"model_type": "medusa", "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
                "truncated_vocab_size": c.token_map_size or c.vocab_size, "medusa_fc_bias": True,
                "original_lm_head": not c.own_lm_head}
    if c.kind == "eagle3":
        layers = list(c.aux_layers)
        if engine == "sglang":
            if min(layers) < 1:
                raise ValueError(f"aux layer 0 (the embeddings) cannot be named for SGLang, which captures the "
                                 f"output of the layer it is given: train with aux layers >= 1 (got {layers})")
            layers = [i - 1 for i in layers]
        return {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
                "eagle_aux_hidden_state_layer_ids": layers,
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layers}}
    return {}


def _layer(layer, prefix: str) -> dict[str, torch.Tensor]:
    """Our DecoderLayer's tensors under Llama's names; its input norm, when it has one, is not written."""
    q, k, v = layer.qkv.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
    gate, up = layer.gate_up.weight.chunk(2)
    tensors = {f"{prefix}self_attn.q_proj.weight": q, f"{prefix}self_attn.k_proj.weight": k,
               f"{prefix}self_attn.v_proj.weight": v, f"{prefix}self_attn.o_proj.weight": layer.o.weight,
               f"{prefix}post_attention_layernorm.weight": layer.post_norm.weight,
               f"{prefix}mlp.gate_proj.weight": gate, f"{prefix}mlp.up_proj.weight": up,
               f"{prefix}mlp.down_proj.weight": layer.down.weight}
    if layer.qkv.bias is not None:
        q, k, v = layer.qkv.bias.split([layer.q_size, layer.kv_size, layer.kv_size])
        tensors.update({f"{prefix}self_attn.q_proj.bias": q, f"{prefix}self_attn.k_proj.bias": k,
                        f"{prefix}self_attn.v_proj.bias": v})
    return tensors


def _eagle(head, engine: str) -> dict[str, torch.Tensor]:
    bias = head.fc.bias
    tensors = {"fc.weight": head.fc.weight, **_layer(head.layer, "layers.0.")}
    if engine == "vllm":
        if bias is not None and bias.any():
            raise ValueError("vLLM's EAGLE-1 layer has no bias on fc, and this head's fc has one: train with "
                             "--model.init_args.fc_bias false to export for vLLM, or export --format sglang")
    else:  # SGLang's fc always has a bias and keeps a random one when the file has none
        tensors["fc.bias"] = bias if bias is not None else torch.zeros(head.config.hidden_size)
    return tensors


def _eagle3(head, engine: str) -> dict[str, torch.Tensor]:
    return {"fc.weight": head.fc.weight, "midlayer.input_layernorm.weight": head.input_norm.weight,
            "midlayer.hidden_norm.weight": head.hidden_norm.weight, **_layer(head.layer, "midlayer."),
            "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight, "d2t": head.d2t, "t2d": head.t2d}


def _medusa(head, engine: str) -> dict[str, torch.Tensor]:
    """With the target's LM head shared (original_lm_head), one copy of it as lm_heads.0; with a token map, the
    map's rows and the map as `token_map`."""
    tensors = {} if head.token_map is None else {"token_map": head.token_map}
    for i, blocks in enumerate(head.heads):
        for j, block in enumerate(blocks):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias
        if head.config.own_lm_head:
            tensors[f"lm_heads.{i}.weight"] = head.lm_heads[i].weight
    if not head.config.own_lm_head:
        tensors["lm_heads.0.weight"] = head.target.lm_head.weight
    return tensors
