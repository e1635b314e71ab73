"""OpenAI's n through `draftheads serve`: one request for n samples against n separate requests for the same prompt
(the siblings of n read the prompt's blocks from the prefix cache instead of computing them), and speculation's
speedup over plain decoding with n samples of one prompt against n different prompts at once (the same number of
sequences in flight). Two servers, plain and speculative, are measured taking turns round by round (the machine's
speed drifts); every request is sampled (temperature 0.7, seeded) and ignores EOS, so each setting generates the
same number of tokens. Each setting's prompts open with a system message of their own (the round and setting), so no
setting reads another's prompts from the prefix cache. With --context-words N that system message also carries a
document of N words (prompt-heavy work, where computing the prompt once for n samples saves most). Each setting
sends its prompts one after the other:

- n: one request with n samples per prompt;
- separate: n requests at once for the prompt, seeds seed + i (the samples n gives); the engine admits them over
  the steps of the first one's prefill and they take its computed blocks from the prefix cache, so they share
  most of the prompt's work too;
- unshared: the same n requests on servers without prefix caching (`--no-enable-prefix-caching`): each computes
  the whole prompt, the work n saves;
- different: n requests at once, n different prompts, one sample each.

    python benchmarks/n_samples.py [--speculative-config JSON] [--prompts humaneval] [--num-prompts 4] [--n 4]
        [--max-new-tokens 64] [--rounds 2] [--context-words 0] [--target smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from serving.bench.bench_serve import ServerProcess, load_first_turns
from serving.spec_decode.metrics import AcceptanceStats
from serving.targets import DEFAULT_TARGET

SETTINGS = ("n", "separate", "unshared", "different")


async def ask(client: httpx.AsyncClient, messages, n: int, seed: int, max_tokens: int) -> dict:
    response = await client.post("/v1/chat/completions", json={
        "messages": messages, "n": n, "seed": seed, "temperature": 0.7, "max_tokens": max_tokens, "ignore_eos": True})
    response.raise_for_status()
    return response.json()["usage"]


def unshared(prompts, label: str, document: str = ""):
    """The prompts under a system message naming `label` (then `document`): nothing of them is in the prefix cache
    yet."""
    system = f"Run {label}. {document}".strip()
    return [[{"role": "system", "content": system}, *[m for m in messages if m["role"] != "system"]]
            for messages in prompts]


def document_of(prompts, num_words: int) -> str:
    """`num_words` words cycled from the prompts' own text."""
    words = " ".join(m["content"] for messages in prompts for m in messages).split()
    return " ".join(words[i % len(words)] for i in range(num_words)) if num_words else ""


async def run_setting(url: str, setting: str, prompts, n: int, max_tokens: int) -> dict:
    """Output tokens per second over the prompts, and the acceptance summed over every sample."""
    usages = []
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        start = time.perf_counter()
        for i, messages in enumerate(prompts):
            if setting == "n":
                usages.append(await ask(client, messages, n, 1000 * i, max_tokens))
            elif setting in ("separate", "unshared"):
                usages += await asyncio.gather(*(ask(client, messages, 1, 1000 * i + j, max_tokens) for j in range(n)))
            else:  # n different prompts at once, each prompt's turn starting a group
                group = [prompts[(i + j) % len(prompts)] for j in range(n)]
                usages += await asyncio.gather(*(ask(client, m, 1, 1000 * i + j, max_tokens)
                                                 for j, m in enumerate(group)))
        elapsed = time.perf_counter() - start
    stats = AcceptanceStats()
    for usage in usages:
        if "speculative" in usage:
            stats.merge(AcceptanceStats.from_dict(usage["speculative"]))
    return {"tok_s": sum(u["completion_tokens"] for u in usages) / elapsed,
            "tau": stats.tau if stats.num_steps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                        metavar="JSON")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--context-words", type=int, default=0,
                        help="words of a document each prompt carries in its system message")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()

    prompts = load_first_turns(args.prompts, args.num_prompts)
    document = document_of(prompts, args.context_words)
    common = ["--target", args.target, "--max-num-seqs", "16", "--log-level", "warning"]
    rows = []
    speculative_options = ["--speculative-config", args.speculative_config]
    no_cache = ["--no-enable-prefix-caching"]
    with ServerProcess(common) as plain, ServerProcess(common + speculative_options) as speculative, \
            ServerProcess(common + no_cache) as plain_no_cache, \
            ServerProcess(common + speculative_options + no_cache) as speculative_no_cache:
        servers = {False: (("plain", plain), ("speculative", speculative)),
                   True: (("plain", plain_no_cache), ("speculative", speculative_no_cache))}
        for url in (plain.url, speculative.url, plain_no_cache.url, speculative_no_cache.url):  # warm-up
            asyncio.run(run_setting(url, "n", prompts[:1], 2, 4))
        for round_ in range(args.rounds):
            row = {"round": round_}
            for setting in SETTINGS:
                for name, server in servers[setting == "unshared"]:
                    fresh = unshared(prompts, f"{round_}-{setting}-{name}", document)
                    result = asyncio.run(run_setting(server.url, setting, fresh, args.n, args.max_new_tokens))
                    row[f"{name}_{setting}_tok_s"] = result["tok_s"]
                    if result["tau"] is not None:
                        row[f"{name}_{setting}_tau"] = result["tau"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    median = lambda key: statistics.median(r[key] for r in rows)
    summary = {"target": args.target, "speculative_config": args.speculative_config, "prompts": args.prompts,
               "num_prompts": args.num_prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
               "context_words": args.context_words, "rounds": rows}
    for name in ("plain", "speculative"):
        summary[f"{name}_n_over_separate"] = median(f"{name}_n_tok_s") / median(f"{name}_separate_tok_s")
        summary[f"{name}_n_over_unshared"] = median(f"{name}_n_tok_s") / median(f"{name}_unshared_tok_s")
        print(f"{name}: n={args.n} {median(f'{name}_n_tok_s'):.1f} tok/s, {args.n} separate requests "
              f"{median(f'{name}_separate_tok_s'):.1f} tok/s ({summary[f'{name}_n_over_separate']:.3f}x), "
              f"without prefix caching {median(f'{name}_unshared_tok_s'):.1f} tok/s "
              f"({summary[f'{name}_n_over_unshared']:.3f}x), "
              f"{args.n} different prompts {median(f'{name}_different_tok_s'):.1f} tok/s")
    for setting in SETTINGS:
        summary[f"speedup_{setting}"] = median(f"speculative_{setting}_tok_s") / median(f"plain_{setting}_tok_s")
        print(f"speculation's speedup, {setting}: {summary[f'speedup_{setting}']:.3f}x (tau "
              f"{median(f'speculative_{setting}_tau'):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
