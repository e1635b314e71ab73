"""`draftheads`: one console script, one subcommand per stage. Each subcommand's module defines
`add_arguments(parser)` and `run(args)`; it is imported only when that subcommand runs, so
`draftheads info` does not pay for Lightning."""
from __future__ import annotations

import argparse
import importlib
import sys
from functools import partial

COMMANDS = {
    "info": ("serving.targets", "print a target's resolved folder, architecture, sizes, dtype and fingerprint (JSON)"),
    "prompts": ("serving.bench.prompts", "print a prompt source as JSONL (sharegpt, sharegpt-heldout, mt-bench, humaneval, or a file)"),
    "bench": ("serving.bench.cli", "benchmark the engine: plain decoding and speculative configs side by side"),
    "serve": ("serving.server.serve", "serve the engine over an OpenAI-compatible HTTP API, with Prometheus metrics"),
    "bench-serve": ("serving.bench.bench_serve", "benchmark a running OpenAI-compatible server (ours, vLLM, SGLang) under load"),
    "generate": ("training.data.generate", "let the target answer prompts and store its answers and hidden states"),
    "token-map": ("training.data.vocab", "write a store's most frequent answer tokens as a token map for drafting"),
    "fit": ("training.fit", "train a draft head from a YAML config (LightningCLI fit)"),
    "validate": ("training.fit", "validate a draft head from a YAML config (LightningCLI validate)"),
    "export": ("training.export", "convert a head folder to the format vLLM or SGLang loads"),
    "import": ("training.import_head", "read a published or exported EAGLE-1, EAGLE-3 or Medusa head into a head folder"),
    "check": ("training.check", "compare a head's acceptance per position: trained, served by the engine, by vLLM"),
}

# Each command's --help ends with one of these, a command that runs as written after `make demo` (or with the
# store and heads it names).
EXAMPLES = {
    "info": "draftheads info --target smollm2-135m-instruct",
    "prompts": "draftheads prompts --source mt-bench --limit 3",
    "bench": "draftheads bench -c configs/bench.yaml --num-prompts 2",
    "serve": "draftheads serve --port 8000 --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'",
    "bench-serve": "draftheads bench-serve --endpoint http://127.0.0.1:8000 --prompts mt-bench --num-prompts 8",
    "generate": "draftheads generate -c configs/generate.yaml --num-prompts 64",
    "token-map": "draftheads token-map --store data/demo-smollm2-135m-instruct --size 4096 --out runs/token_map-4096.pt",
    "fit": "draftheads fit -c configs/eagle3.yaml -c configs/demo/eagle3.yaml",
    "validate": "draftheads validate -c configs/eagle3.yaml --ckpt_path last",
    "export": "draftheads export runs/eagle3/heads/best --format vllm --out exported/eagle3",
    "import": "draftheads import exported/eagle3 --format eagle3 --out heads/eagle3",
    "check": "draftheads check runs/eagle3/heads/best --prompts mt-bench --num-prompts 8 --vllm off",
}


class DocHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """For a subcommand whose description is its module's docstring, laid out as written, with the defaults shown."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The defaults shown, the description filled to the terminal, the example kept on one line to copy."""

    def _fill_text(self, text, width, indent):
        return indent + text if text.startswith("example: ") else super()._fill_text(text, width, indent)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="draftheads",
        description="Train speculative-decoding draft heads on a frozen target's own outputs and measure them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<12} {help}" for name, (_, help) in COMMANDS.items())
        + "\n\n`draftheads COMMAND --help` explains each command's options.",
    )
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv[:1] or ["--help"])
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    if hasattr(module, "main"):  # LightningCLI parses its own arguments
        command = partial(module.main, name, rest)
    else:
        sub = argparse.ArgumentParser(prog=f"draftheads {name}", description=COMMANDS[name][1],
                                      formatter_class=HelpFormatter)
        module.add_arguments(sub)
        sub.epilog = f"example: {EXAMPLES[name]}"
        command = partial(module.run, sub.parse_args(rest))
    try:
        return command() or 0
    except (ValueError, FileNotFoundError) as error:  # bad input: the message says what to do, no traceback
        print(f"draftheads {name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
