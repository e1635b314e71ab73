"""Run by the interop tests with speculators' venv (`make speculators`), never imported by this project: builds a
tiny draft model of speculators' own classes for a target folder, as its trainer does (from_training_args: the
target's sizes in a one-layer transformer_layer_config, its defaults otherwise, the verifier's embedding and LM head
loaded), saves it with save_pretrained, and runs its forward on given inputs.

    python speculators_side.py build KIND TARGET OUT [--draft-ids IDS.pt] [--block-size B] [--embed-requires-grad]
                                 [--perturb-embedding]
    python speculators_side.py drafts KIND FOLDER INPUTS.pt OUTPUT.pt
    python speculators_side.py resave KIND FOLDER OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, Qwen3Config

from speculators.models import DFlashDraftModel, Eagle3DraftModel, PEagleDraftModel

MODELS = {"eagle3": Eagle3DraftModel, "peagle": PEagleDraftModel, "dflash": DFlashDraftModel}
LAYER_CONFIGS = {"eagle3": LlamaConfig, "peagle": LlamaConfig, "dflash": Qwen3Config}  # its trainer's draft_arch
ATTENTION = "eager"  # flex attention wants a compiler on CPU
MASK_TOKEN = 7  # what its trainer resolves first: an explicit --mask-token-id (the tiny target has no tokenizer)


def layer_config(kind: str, target: Path, num_layers: int):
    """The draft's decoder config as speculators' trainer derives it from the verifier (every layer full
    attention)."""
    verifier = json.loads((target / "config.json").read_text())
    return LAYER_CONFIGS[kind](
        vocab_size=verifier["vocab_size"], hidden_size=verifier["hidden_size"],
        intermediate_size=verifier["intermediate_size"], num_hidden_layers=num_layers,
        num_attention_heads=verifier["num_attention_heads"], num_key_value_heads=verifier["num_key_value_heads"],
        hidden_act=verifier.get("hidden_act", "silu"), max_position_embeddings=verifier["max_position_embeddings"],
        rms_norm_eps=verifier["rms_norm_eps"], head_dim=verifier.get("head_dim"), tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": verifier.get("rope_theta", 10000.0)},
        layer_types=["full_attention"] * num_layers)


def build(args) -> None:
    torch.manual_seed(args.seed)
    target = Path(args.target)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    d2t = t2d = None
    draft_vocab_size = vocab
    if args.draft_ids:
        ids = torch.load(args.draft_ids).sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        d2t, draft_vocab_size = ids - torch.arange(len(ids)), len(ids)
    num_layers = 2 if args.kind == "dflash" else 1
    kwargs = dict(verifier_name_or_path=str(target), draft_vocab_size=draft_vocab_size, norm_before_residual=True,
                  ttt_steps=3, draft_attn_impl=ATTENTION, num_depths=4, block_size=args.block_size,
                  mask_token_id=MASK_TOKEN, **({"embed_requires_grad": True} if args.embed_requires_grad else {}))
    model = MODELS[args.kind].from_training_args(layer_config(args.kind, target, num_layers), t2d=t2d, d2t=d2t,
                                                 **kwargs)
    with torch.no_grad():  # its fresh norms are ones: make them matter in the comparison
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "verifier" not in name:
                param.add_(0.1 * torch.randn(param.shape))
        if args.perturb_embedding:  # as its training moves a trainable embedding (embed_requires_grad) ...
            model.embed_tokens.weight.add_(0.05 * torch.randn(model.embed_tokens.weight.shape))
            # ... and weighs it: at its random init the attention over the embedding barely moves the drafts
            model.layers[0].input_layernorm.weight.mul_(30)
    model.save_pretrained(args.out)


def drafts(args) -> None:
    """EAGLE-3's training-time-test drafts (P-EAGLE's depth 0 the same way) for the inputs' hidden_states
    [1, S, num_aux * hidden] and input_ids [1, S]: draft ids [steps, S]."""
    inputs = torch.load(args.inputs)
    cls = MODELS[args.kind]
    config = cls.config_class.from_pretrained(args.folder)
    config.transformer_layer_config._attn_implementation = ATTENTION  # read when the model is made
    model = cls.from_pretrained(args.folder, config=config).eval()
    num_positions = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = Eagle3DraftModel.forward(model, hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                                       document_ids=torch.zeros(1, num_positions, dtype=torch.long),
                                       position_ids=torch.arange(num_positions)[None], ttt_steps=inputs["steps"])
    torch.save(torch.cat(out), args.output)


def resave(args) -> None:
    """A checkpoint read by from_pretrained and written again by save_pretrained: what speculators writes of it."""
    MODELS[args.kind].from_pretrained(args.folder).save_pretrained(args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build")
    b.add_argument("kind", choices=MODELS)
    b.add_argument("target")
    b.add_argument("out")
    b.add_argument("--draft-ids")
    b.add_argument("--block-size", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--embed-requires-grad", action="store_true", help="its EAGLE-3 option (P-EAGLE's default: on)")
    b.add_argument("--perturb-embedding", action="store_true")
    d = commands.add_parser("drafts")
    d.add_argument("kind", choices=MODELS)
    d.add_argument("folder")
    d.add_argument("inputs")
    d.add_argument("output")
    r = commands.add_parser("resave")
    r.add_argument("kind", choices=MODELS)
    r.add_argument("folder")
    r.add_argument("out")
    args = parser.parse_args()
    {"build": build, "drafts": drafts, "resave": resave}[args.command](args)


if __name__ == "__main__":
    main()
