"""Acceptance at long context with and without a draft window: two EAGLE-3 heads fit identically on one store of
short conversations (the demo's recipe and store settings, --epochs), one of them with `draft_window` W, benched on
prompts of about --prompt-tokens tokens, each made of ShareGPT held-out first turns followed by a HumanEval problem
(the request the answer is to), with plain decoding on the same prompts: tau, per-position acceptance and speedup
side by side, in <out>/long_context.json and .md.

The store is made first when --store does not exist (`draftheads generate -c configs/demo/generate.yaml`, the first
--store-prompts conversations); fits that ended in --out with the same arguments are reused (benchmarks/head_fits.py).

example: python -m benchmarks.long_context --store data/long-context-store --out runs/long-context --window 256
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.head_fits import prepare, run_fit
from serving.bench.prompts import load_prompts
from training import demo

KIND = "eagle3"
NUM_DRAFTS = demo.NUM_SPECULATIVE_TOKENS
PIECE_TOKENS = 1024  # a ShareGPT turn longer than this is cut, so that each prompt mixes several


def parse_args(argv=None) -> argparse.Namespace:
    from serving.targets import DEFAULT_TARGET

    p = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.rsplit("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="the store both heads fit on; made here when it does not exist")
    p.add_argument("--store-prompts", type=int, default=384, help="ShareGPT conversations of a store made here")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", required=True, help="folder of the fits, the long prompts and the report")
    p.add_argument("--window", type=int, default=256, help="draft_window of the windowed head, in keys")
    p.add_argument("--epochs", type=int, default=1, help="epochs of each fit (the demo's recipe otherwise)")
    p.add_argument("--prompt-tokens", type=int, default=4000, help="tokens of each long prompt, about")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--nice", type=int, default=19, help="niceness of this process and its fits")
    p.add_argument("--precision", default=None, help="the fits' precision (default: the demo's, fit_precision)")
    return p.parse_args(argv)


def long_prompts(target: str, num_prompts: int, prompt_tokens: int, path: Path) -> list[int]:
    """Writes `num_prompts` long prompts to the JSONL file `path`: ShareGPT held-out first turns (each cut to
    PIECE_TOKENS), as many as bring the text to about `prompt_tokens` tokens, then a HumanEval problem. Returns each
    prompt's token count under the target's chat template."""
    from transformers import AutoTokenizer

    from serving.targets import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(target))
    turns = [row["messages"][0]["content"] for row in load_prompts("sharegpt-heldout")]
    problems = [row["messages"][-1]["content"] for row in load_prompts("humaneval")]
    lengths, next_turn = [], 0
    with open(path, "w", encoding="utf-8") as out:
        for i in range(num_prompts):
            request = problems[i % len(problems)]
            parts, size = [], len(tokenizer(request)["input_ids"])
            while size < prompt_tokens:
                ids = tokenizer(turns[next_turn % len(turns)])["input_ids"][:PIECE_TOKENS]
                next_turn += 1
                ids = ids[:prompt_tokens - size]
                parts.append(tokenizer.decode(ids))
                size += len(ids)
            text = "\n\n".join(f"Document {n + 1}:\n{part}" for n, part in enumerate(parts)) + "\n\n" + request
            messages = [{"role": "user", "content": text}]
            templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            lengths.append(len(tokenizer(templated, add_special_tokens=False)["input_ids"]))
            out.write(json.dumps({"id": f"long-{i}", "category": "long", "messages": messages}) + "\n")
    return lengths


def make_store(args) -> None:
    from training.cli import main as draftheads

    command = ["generate", "-c", str(demo.DEMO_CONFIGS / "generate.yaml"), "--target", args.target,
               "--num-prompts", str(args.store_prompts), "--out", args.store]
    print(f"==> draftheads {' '.join(command)}", flush=True)
    if draftheads(command) != 0:
        raise RuntimeError("draftheads generate failed")


def bench(args, heads: dict[int, str], prompts: Path, out: Path) -> dict:
    """One `draftheads bench` over both heads on the long prompts; its JSON result."""
    from training.cli import main as draftheads

    command = ["bench", "--target", args.target, "--prompts", str(prompts), "--num-prompts", str(args.num_prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--json", str(out / "bench.json")]
    for head in heads.values():
        command += ["--speculative-config", json.dumps({"method": KIND, "model": head,
                                                        "num_speculative_tokens": NUM_DRAFTS})]
    print(f"==> draftheads {' '.join(command)}", flush=True)
    if draftheads(command) != 0:
        raise RuntimeError("draftheads bench failed")
    return json.loads((out / "bench.json").read_text())


def to_markdown(rows: list[dict]) -> str:
    """Per head: tau, the conditional acceptance at each draft position (accepted / reached), speedup over plain
    decoding, and whether greedy outputs were plain decoding's."""
    lines = ["| head | draft_window | tau | " + " | ".join(f"acc_{i}" for i in range(1, NUM_DRAFTS + 1))
             + " | speedup | identical |", "|---" * (NUM_DRAFTS + 5) + "|"]
    for row in rows:
        accepted = [f"{p['conditional']:.3f}" if p["reached"] else "-" for p in row["per_position"]]
        accepted += ["-"] * (NUM_DRAFTS - len(accepted))
        lines.append(f"| {row['name']} | {row['window']} | {row['tau']:.3f} | " + " | ".join(accepted)
                     + f" | {row['speedup']:.2f}x | {row['identical']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = prepare(args)
    start = time.perf_counter()
    if not Path(args.store).exists():
        make_store(args)
    fits = {}
    for window in (0, args.window):
        overrides = ["--trainer.precision", args.precision, "--trainer.max_epochs", str(args.epochs),
                     "--model.init_args.draft_window", str(window)]
        fits[window] = run_fit(KIND, args, overrides, out / f"{KIND}-window-{window}")
    prompts = out / "long-prompts.jsonl"
    lengths = long_prompts(args.target, args.num_prompts, args.prompt_tokens, prompts)
    result = bench(args, {window: fit["head"] for window, fit in fits.items()}, prompts, out)
    by_head = {row["config"]["model"]: row for row in result["rows"] if row["config"]}
    rows = []
    for window, fit in fits.items():
        row = by_head[fit["head"]]
        rows.append({"name": "full attention" if not window else f"window {window}", "window": window,
                     "tau": row["tau"], "per_position": row["per_position"], "speedup": row["speedup"],
                     "identical": row["identical_to_plain"], "fit_seconds": fit["seconds"], "head": fit["head"]})
    report = {"store": str(Path(args.store).resolve()), "target": args.target, "epochs": args.epochs,
              "prompt_tokens": lengths, "max_new_tokens": args.max_new_tokens, "rows": rows,
              "seconds": time.perf_counter() - start}
    (out / "long_context.json").write_text(json.dumps(report, indent=2))
    markdown = (f"prompts: {len(lengths)} of {min(lengths)}-{max(lengths)} tokens, {args.max_new_tokens} new tokens "
                f"each, greedy\n\n" + to_markdown(rows))
    (out / "long_context.md").write_text(markdown)
    print("\n" + markdown + f"\nwrote {out / 'long_context.json'} and {out / 'long_context.md'} in "
          f"{report['seconds']:.0f} s")
    return report


if __name__ == "__main__":
    main()
