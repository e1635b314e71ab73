"""What serving over HTTP costs: `draftheads serve` measured by `draftheads bench-serve` against the same engine
run offline in this process, on the same prompts, taking turns round by round (the machine's speed drifts).

At concurrency 1 it compares time per output token after the first (the server's TPOT as a client sees it over
streamed chunks; the offline engine's from its own request timings) and inter-chunk latency; at concurrency 16 it
compares output tokens per second (all prompts at once, max_num_seqs 16). Requests ignore EOS, so both sides
generate the same number of tokens. With a speculative config it also prints the acceptance at concurrency 1 both
ways: the offline requests' counts summed, and the difference of the server's /metrics counters.

    python benchmarks/server_overhead.py [--speculative-config JSON] [--num-prompts 8] [--max-new-tokens 64]
        [--rounds 3] [--target debug]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from serving.bench.bench_serve import BenchServeConfig, ServerProcess, arrival_times, load_first_turns, measure
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.spec_decode.metrics import AcceptanceStats
from serving.targets import DEFAULT_TARGET


def offline_run(engine: Engine, prompts, max_new_tokens: int, concurrency: int) -> dict:
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    engine.scheduler.max_num_seqs = concurrency
    outputs, start = [], time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        outputs += engine.generate(prompts[first:first + concurrency], params)
    duration = time.perf_counter() - start
    tpots = [(o.metrics["latency_s"] - o.metrics["time_to_first_token_s"]) / (len(o.token_ids) - 1) for o in outputs]
    stats = AcceptanceStats()
    for output in outputs:
        if "spec" in output.metrics:
            stats.merge(AcceptanceStats.from_dict(output.metrics["spec"]))
    return {"output_throughput": sum(len(o.token_ids) for o in outputs) / duration,
            "tpot_ms": 1e3 * statistics.fmean(tpots),
            "acceptance": {"acceptance_rate": stats.acceptance_rate, "tau": stats.tau,
                           "num_accepted_per_position": stats.accepted} if stats.num_steps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--speculative-config", default=None, metavar="JSON")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts at concurrency 1 (16 are used at 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=torch.get_num_threads(),
                        help="engine threads on both sides (default: torch's, one per core)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()

    serve_options = ["--target", args.target, "--max-num-seqs", "16", "--log-level", "warning", "--num-threads",
                     str(args.num_threads)]
    if args.speculative_config:
        serve_options += ["--speculative-config", args.speculative_config]
    engine = Engine(EngineConfig(args.target, max_num_seqs=16, speculative_config=args.speculative_config,
                    num_threads=args.num_threads))
    few, many = load_first_turns(args.prompts, args.num_prompts), load_first_turns(args.prompts, 16)
    one = BenchServeConfig(num_prompts=len(few), max_new_tokens=args.max_new_tokens, max_concurrency=1, ignore_eos=True)
    sixteen = BenchServeConfig(num_prompts=16, max_new_tokens=args.max_new_tokens, max_concurrency=16, ignore_eos=True)
    engine.generate(few[:1], SamplingParams(max_tokens=4))  # warm-up
    rows = []
    with ServerProcess(serve_options) as server:
        for round_ in range(args.rounds):
            served_1 = measure(server.url, few, arrival_times(len(few), one.request_rate, 0), one, "server")
            offline_1 = offline_run(engine, few, args.max_new_tokens, 1)
            served_16 = measure(server.url, many, arrival_times(16, sixteen.request_rate, 0), sixteen, "server")
            offline_16 = offline_run(engine, many, args.max_new_tokens, 16)
            row = {"round": round_, "offline_tpot_ms_c1": offline_1["tpot_ms"],
                   "server_tpot_ms_c1": served_1["latency_ms"]["tpot"]["mean"],
                   "server_itl_ms_c1": served_1["latency_ms"]["itl"]["mean"],
                   "server_itl_median_ms_c1": served_1["latency_ms"]["itl"]["median"],
                   "offline_tok_s_c16": offline_16["output_throughput"],
                   "server_tok_s_c16": served_16["output_throughput"],
                   "server_acceptance_c1": served_1["acceptance"], "offline_acceptance_c1": offline_1["acceptance"]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if "acceptance" not in k}), flush=True)
            if offline_1["acceptance"]:
                offline, served = offline_1["acceptance"], served_1["acceptance"]
                print(f"  acceptance at concurrency 1: offline rate {offline['acceptance_rate']:.4f} tau "
                      f"{offline['tau']:.4f}; through /metrics rate {served['acceptance_rate']:.4f} tau "
                      f"{served['tau']:.4f}; accepted per position offline {offline['num_accepted_per_position']}, "
                      f"server {[int(n) for n in served['num_accepted_per_position']]}", flush=True)
    median = lambda key: statistics.median(r[key] for r in rows)
    summary = {"target": args.target, "num_threads": args.num_threads, "speculative_config": args.speculative_config,
               "rounds": rows,
               "tpot_server_over_offline_c1": median("server_tpot_ms_c1") / median("offline_tpot_ms_c1"),
               "itl_server_over_offline_tpot_c1": median("server_itl_ms_c1") / median("offline_tpot_ms_c1"),
               "throughput_server_over_offline_c16": median("server_tok_s_c16") / median("offline_tok_s_c16")}
    print(f"concurrency 1: offline {median('offline_tpot_ms_c1'):.2f} ms/token, server TPOT "
          f"{median('server_tpot_ms_c1'):.2f} ms ({summary['tpot_server_over_offline_c1']:.3f}x), server ITL "
          f"{median('server_itl_ms_c1'):.2f} ms ({summary['itl_server_over_offline_tpot_c1']:.3f}x)")
    print(f"concurrency 16: offline {median('offline_tok_s_c16'):.1f} tok/s, server {median('server_tok_s_c16'):.1f} "
          f"tok/s ({summary['throughput_server_over_offline_c16']:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
