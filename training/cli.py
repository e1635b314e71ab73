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
}


class DocHelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """For a subcommand whose description is its module's docstring, laid out as written, with the defaults shown."""


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
                                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(sub)
        command = partial(module.run, sub.parse_args(rest))
    try:
        return command() or 0
    except (ValueError, FileNotFoundError) as error:  # bad input: the message says what to do, no traceback
        print(f"draftheads {name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
