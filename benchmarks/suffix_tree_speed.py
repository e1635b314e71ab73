"""The suffix trees' own time on real tokens (serving/drafters/suffix_tree.py): the first halves of HumanEval's
first 40 prompts (the target's tokenizer) as prompts, 120 requests one after another, each answering with another
prompt's second half (64 tokens at most) with 15% of its tokens replaced by tokens of its own prompt, appended one
token at a time; after each token one draft of at most 24 nodes with vLLM's defaults (tree depth 24, 10,000 cached
answers, spec factor 1, min token probability 0.1). Prints microseconds per draft and per answer token added to
both trees (prompts included).

    PYTHONPATH=$PWD python benchmarks/suffix_tree_speed.py
"""
from __future__ import annotations

import random
import time

from transformers import AutoTokenizer

from serving.bench.prompts import load_prompts
from serving.drafters.suffix_tree import SuffixCache
from serving.targets import DEFAULT_TARGET, resolve


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET))
    seqs = [tokenizer(row["messages"][0]["content"])["input_ids"] for row in load_prompts("humaneval", 40)]
    rng = random.Random(0)
    cache = SuffixCache(24, 10000)
    num, drafting, adding = 0, 0.0, 0.0
    for key in range(120):
        own = seqs[key % len(seqs)]
        prompt = own[:len(own) // 2]
        other = seqs[rng.randrange(len(seqs))]
        answer = [t if rng.random() > 0.15 else rng.choice(own) for t in other[len(other) // 2:][:64]]
        start = time.perf_counter()
        cache.start(key, prompt)
        adding += time.perf_counter() - start
        context = list(prompt)
        for token in answer:
            context.append(token)
            start = time.perf_counter()
            cache.add(key, [token])
            middle = time.perf_counter()
            cache.speculate(key, context, 24, 1.0, 0.1)
            adding += middle - start
            drafting += time.perf_counter() - middle
            num += 1
        cache.stop(key)
    print(f"{num} answer tokens: {drafting / num * 1e6:.0f} us per draft, {adding / num * 1e6:.0f} us per token added "
          "(prompts included)")


if __name__ == "__main__":
    main()
