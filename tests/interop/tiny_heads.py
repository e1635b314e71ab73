"""A tiny target vLLM serves and heads of each kind briefly trained on it, for the interop tests: the "chaotic"
target of tests/training (hidden 128, untied, larger init, the default target's tokenizer), whose greedy answers
differ per prompt and never settle, so a head drafts well only where it learned them. And a "cycling" target (the
same at a smaller init), whose greedy answers fall into short cycles of a few tokens that differ per prompt: a head
fitted on them drafts new prompts' answers too, reading the target's features to tell the cycles apart (what
`draftheads check` needs: a held-out accuracy that means something, a head that fails when its features are
mixed up)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from serving.targets import DEFAULT_TARGET, build_tiny_model, resolve
from training.data.generate import GenerateConfig, generate
from training.fit import build_cli

ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS, MAX_NEW_TOKENS = 8, 24
# EAGLE-3's aux layers: three distinct ones (the 4-layer target's default 2, L//2, L-3 names layer 2 twice, which the
# speculators format cannot size fc for).
AUX_LAYERS = (1, 2, 3)
# Per kind: fit overrides and optimizer steps (those of tests/training/test_fit.py's overfit test, which reach tau
# above 1.6 on this target). EAGLE-1's fc has no bias: vLLM's has none (and drops one it is given).
FIT = {
    "medusa": ["--model.init_args.learning_rate=1e-2", "--trainer.max_steps=24"],
    "eagle": ["--model.init_args.learning_rate=1e-2", "--model.init_args.noise=0", "--model.init_args.fc_bias=false",
              "--trainer.max_steps=40"],
    "eagle3": ["--model.init_args.learning_rate=1e-2", "--model.init_args.num_steps=4",
               f"--model.init_args.aux_layers=[{','.join(map(str, AUX_LAYERS))}]",
               "--model.init_args.draft_vocab_size=512", "--trainer.max_steps=40"],
    "peagle": ["--model.init_args.learning_rate=1e-2", f"--model.init_args.aux_layers=[{','.join(map(str, AUX_LAYERS))}]",
               "--model.init_args.draft_vocab_size=512", "--trainer.max_steps=40"],
    # the store's aux layers as its target layers; blocks of 5 (4 drafts), no token map (speculators names none)
    "dflash": ["--model.init_args.learning_rate=1e-2", "--model.init_args.block_size=5", "--trainer.max_steps=40"],
}

TOKEN_MAP_SIZE = 512  # the heads trained over a token map: the store's most frequent answer tokens

# EAGLE 3.1's norms, each trained into an EAGLE-3 head of its own (FIT["eagle3"] plus these).
EAGLE31 = {"norm_before_fc": ["--model.init_args.norm_before_fc=true", "--model.init_args.norm_output=true"],
           "fc_norm": ["--model.init_args.fc_norm=true", "--model.init_args.norm_output=true"]}


def prompts(num: int = NUM_PROMPTS) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short note about topic number {i}."}] for i in range(num)]


def chaotic_target(folder: Path, arch: str = "llama", **overrides) -> Path:
    if not (folder / "config.json").is_file():
        build_tiny_model(folder, arch, tokenizer_from=resolve(DEFAULT_TARGET), **{
            "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 8192,
            "tie_word_embeddings": False, "initializer_range": 0.1, **overrides})
    return folder


def cycling_target(folder: Path) -> Path:
    return chaotic_target(folder, initializer_range=0.05)


def prompt_file(path: Path, messages: list[list[dict]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": m}) + "\n" for i, m in enumerate(messages)))
    return path


def store(target: Path, folder: Path, num_prompts: int = NUM_PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS,
          shard_size: int = 8) -> Path:
    """The target's greedy answers to prompts(num_prompts) (folder/prompts.jsonl) with its hidden states, in shards
    of `shard_size` examples (which set the order a fit reads them in)."""
    source = prompt_file(folder / "prompts.jsonl", prompts(num_prompts))
    generate(GenerateConfig(prompts=str(source), out=str(folder / "store"), target=str(target), aux_layers=AUX_LAYERS,
                            max_new_tokens=max_new_tokens, concurrency=8, shard_size=shard_size), progress=False)
    return folder / "store"


def train(kind: str, target: Path, store_folder: Path, root: Path, extra: tuple[str, ...] = ()) -> Path:
    """A head of `kind` fitted briefly on the store, with `extra` fit overrides; its folder (runs/<kind>/heads/last
    under `root`)."""
    args = ["-c", str(ROOT / "configs" / f"{kind}.yaml"), f"--model.init_args.target={target}",
            f"--data.store={store_folder}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.max_epochs=-1", "--data.batch_size=8",
            "--model.init_args.warmup_steps=2", "--trainer.check_val_every_n_epoch=1000",
            "--trainer.num_sanity_val_steps=0", *FIT[kind], *extra]
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(root):
        cli = build_cli(args, run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
    return root / "runs" / kind / "heads" / "last"


def validated(kind: str, root: Path) -> tuple[Path, Path, Path]:
    """(target, head folder, prompts JSONL): a head of `kind` fitted on the tiny target's store with a held-out quarter
    validated every 5 epochs, so that its folder keeps the fit's val/acc_i (what `draftheads check` reads)."""
    target = chaotic_target(root / "target")
    store_folder = store(target, root / "data")
    head = train(kind, target, store_folder, root / "fit", extra=(
        "--data.heldout_fraction=0.25", "--trainer.check_val_every_n_epoch=5"))
    return target, head, root / "data" / "prompts.jsonl"
