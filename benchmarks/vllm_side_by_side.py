"""This project's server against vLLM's CPU build (`make vllm`) on one machine, one after the other, same target,
same prompts, same settings: `draftheads serve` and `vllm serve` (float32, eager, max_num_seqs 16, 1 GiB of K/V,
every core), each measured by `draftheads bench-serve` at each concurrency, for plain decoding, n-gram (vLLM's
defaults, prompt_lookup_min = max = 5, in both) and each --head (served by vLLM from its
`draftheads export --format vllm` export; ours with float32 draft weights, as vLLM's). Requests are greedy chat completions that
ignore EOS, so both servers generate the same number of tokens. Prints one table and writes JSON and markdown.

    python benchmarks/vllm_side_by_side.py [--target smollm2-135m-instruct] [--head eagle3=runs/eagle3/heads/best]
        [--prompts mt-bench] [--num-prompts 8] [--max-new-tokens 64] [--concurrency 1 4 16] [--out results/vllm]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import heads
from serving import targets
from serving.bench.bench_serve import BenchServeConfig, ServerProcess, arrival_times, load_first_turns, measure
from serving.bench.vllm_process import VllmServer, missing_reason
from training import export as exporting

K = 4
MAX_NUM_SEQS = 16


def methods(head_folders: list[str], out: Path) -> list[tuple[str, dict | None, dict | None]]:
    """(name, our speculative config, vLLM's) per method: plain, ngram, then each head (KIND=FOLDER), served by
    vLLM from its `--format vllm` export."""
    rows = [("plain", None, None), ("ngram", {"method": "ngram", "num_speculative_tokens": K},
                                     {"method": "ngram", "num_speculative_tokens": K})]
    for given in head_folders:
        kind, folder = given.split("=", 1)
        head = heads.load(folder)
        if head.config.kind != kind:
            raise SystemExit(f"{folder} holds a {head.config.kind} head, not {kind}")
        exported = exporting.export(head, "vllm", out / f"{kind}-vllm")
        rows.append((kind, {"method": kind, "model": folder, "num_speculative_tokens": K, "draft_weights": "float32"},
                     {"method": kind, "model": str(exported), "num_speculative_tokens": K}))
    return rows


def bench(url: str, label: str, turns, concurrency: int, args) -> dict:
    config = BenchServeConfig(endpoint=url, prompts=args.prompts, num_prompts=len(turns), max_concurrency=concurrency,
                              max_new_tokens=args.max_new_tokens, ignore_eos=True, label=label)
    return measure(url, turns, arrival_times(len(turns), config.request_rate, 0), config, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=targets.DEFAULT_TARGET)
    parser.add_argument("--head", action="append", default=[], metavar="KIND=FOLDER",
                        help="a head folder for the target (eagle, eagle3, medusa), repeatable")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=8, help="per concurrency (at least the concurrency)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", default="results/vllm_side_by_side")
    args = parser.parse_args()
    if missing_reason():
        raise SystemExit(missing_reason())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = targets.resolve(args.target)
    threads = str(os.cpu_count())
    ours_options = ["--target", str(folder), "--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS),
                    "--kv-cache-memory-gib", "1", "--num-threads", threads, "--max-model-len", "2048"]
    rows = []
    for name, ours_spec, vllm_spec in methods(args.head, out):
        for engine in ("draftheads", "vllm"):
            spec = ours_spec if engine == "draftheads" else vllm_spec
            if engine == "draftheads":
                options = ours_options + (["--speculative-config", json.dumps(spec)] if spec else [])
                server = ServerProcess(options)
            else:
                server = VllmServer(folder, spec, max_model_len=2048, max_num_seqs=MAX_NUM_SEQS, for_speed=True)
            with server:
                for concurrency in args.concurrency:
                    turns = load_first_turns(args.prompts, max(args.num_prompts, concurrency))
                    run = bench(server.url, f"{engine} {name}", turns, concurrency, args)
                    accepted = run["acceptance"] or {}
                    rows.append({"method": name, "engine": engine, "concurrency": concurrency,
                                 "num_prompts": len(turns), "output_throughput": run["output_throughput"],
                                 "ttft_ms": run["latency_ms"]["ttft"]["median"],
                                 "tpot_ms": run["latency_ms"]["tpot"]["median"],
                                 "mean_acceptance_length": accepted.get("mean_acceptance_length"),
                                 "tau": accepted.get("tau"),
                                 "accepted_per_position": accepted.get("num_accepted_per_position"),
                                 "num_drafts": accepted.get("num_drafts"), "failed": run["num_failed"]})
                    print(json.dumps(rows[-1]), flush=True)
    (out / "side_by_side.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    table = to_markdown(rows, args)
    (out / "side_by_side.md").write_text(table + "\n")
    print(table)


def to_markdown(rows: list[dict], args) -> str:
    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"{args.prompts}, {args.max_new_tokens} new tokens (EOS ignored), greedy, float32, eager vLLM; "
             f"max_num_seqs {MAX_NUM_SEQS}, 1 GiB K/V each", "",
             "| method | concurrency | draftheads out tok/s | vLLM out tok/s | ratio | TTFT ms (ours / vLLM) | "
             "TPOT ms (ours / vLLM) | MAL (ours / vLLM) | accepted per position (ours / vLLM) |",
             "|---|---|---|---|---|---|---|---|---|"]
    pairs = {}
    for row in rows:
        pairs.setdefault((row["method"], row["concurrency"]), {})[row["engine"]] = row
    for (method, concurrency), pair in pairs.items():
        ours, theirs = pair["draftheads"], pair["vllm"]
        lines.append(f"| {method} | {concurrency} | {ours['output_throughput']:.1f} | {theirs['output_throughput']:.1f} | "
                     f"{ours['output_throughput'] / theirs['output_throughput']:.2f}x | "
                     f"{cell(ours['ttft_ms'], '.0f')} / {cell(theirs['ttft_ms'], '.0f')} | "
                     f"{cell(ours['tpot_ms'], '.1f')} / {cell(theirs['tpot_ms'], '.1f')} | "
                     f"{cell(ours['mean_acceptance_length'], '.2f')} / {cell(theirs['mean_acceptance_length'], '.2f')} | "
                     f"{ours['accepted_per_position'] or '-'} / {theirs['accepted_per_position'] or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
