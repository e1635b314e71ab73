"""Prompt lookup against a head, step by step: at every step of a head's greedy drafting (concurrency 1, always
num_speculative_tokens drafts), the chain prompt lookup would propose for a suffix of exactly 3, 2 and 1 tokens and
the head's own chain with its draft probabilities, each scored against the greedy output (which no draft changes),
then rules for choosing between them scored on the same steps.

The steps are those of the head's run, so a rule's numbers compare rules; its tau in the engine is lower, since a
rule that accepts more also steps over more of the repeated text in one step.

    python benchmarks/lookup_rules.py --head runs/eagle/heads/best --kind eagle [--prompts mt-bench] \
        [--num-prompts 24] [--max-new-tokens 96] [--threshold 0.1]
"""
from __future__ import annotations

import argparse

from serving.drafters.heads import ChainCut
from serving.engine import Engine
from serving.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.spec.verify import verify_greedy
from serving.targets import DEFAULT_TARGET

K = 4
SUFFIXES = (3, 2, 1)


def record(engine, prompts, max_new_tokens) -> list[dict]:
    drafter = engine.speculator.drafter
    lookup, head = drafter.lookup, drafter.head
    probs, steps = [], []
    keeps = head.cut.keeps

    def spy_keeps(chain_p, p):
        probs.append(p)
        return keeps(chain_p, p)

    def propose(engine_, requests, budgets, step):
        drafts = {}
        for r in requests:
            found = {}
            for n in SUFFIXES:
                lookup.min_n = lookup.max_n = n
                found[n] = lookup.lookup(r.token_ids, budgets[r.request_id])
            probs.clear()
            budget = {r.request_id: budgets[r.request_id]}
            drafts[r.request_id] = head.propose(engine_, [r], budget, step).get(r.request_id, [])
            if budgets[r.request_id] == K:
                steps.append(dict(request_id=r.request_id, start=len(r.token_ids), lookup=found,
                                  head=drafts[r.request_id], probs=probs[:len(drafts[r.request_id])]))
        return drafts

    head.cut.keeps, drafter.propose = spy_keeps, propose
    finals = {}
    for prompt in prompts:
        [out] = engine.generate([prompt], SamplingParams(max_tokens=max_new_tokens))
        finals[out.request_id] = out.prompt_token_ids + out.token_ids
    for s in steps:
        final = finals[s["request_id"]]
        # the greedy output's tokens after the step's start, and a sentinel past its end, as the target's choices
        s["accepted"] = {source: verify_greedy(final[s["start"]:s["start"] + len(chain)] + [None], chain)[0]
                         for source, chain in [("head", s["head"])] + list(s["lookup"].items())}
    return steps


def cut_length(probs: list[float], cut: ChainCut) -> int:
    """How many of the head's drafts the confidence cut keeps."""
    num, chain_p = 0, 1.0
    for p in probs:
        chain_p, kept = cut.keeps(chain_p, p)
        if not kept:
            break
        num += 1
    return num


def rules(cut: ChainCut) -> dict:
    """name -> step -> (source, number of drafts verified); source is "head" or a suffix length."""
    def lookup_first(n_min, keep_head_above=None, agree=False):
        def choose(s):
            for n in SUFFIXES:
                chain = s["lookup"][n]
                if n < n_min or not chain:
                    continue
                if keep_head_above is not None and s["probs"][0] > keep_head_above:
                    break
                if agree and chain[0] != s["head"][0]:
                    break
                return n, len(chain)
            return "head", cut_length(s["probs"], cut)
        return choose

    def then_agreeing_single(s):
        """lookup >= 2 first; else the 1-token lookup where its first draft is the head's; else the head."""
        source, length = lookup_first(2)(s)
        single = s["lookup"][1]
        if source == "head" and single and s["head"] and single[0] == s["head"][0]:
            return 1, len(single)
        return source, length

    threshold = cut.threshold

    return {
        f"head, p >= {threshold:g}": lambda s: ("head", cut_length(s["probs"], cut)),
        f"lookup >= 1 first, else head p >= {threshold:g}": lookup_first(1),
        f"lookup >= 2 first, else head p >= {threshold:g} (prompt_lookup_first)": lookup_first(2),
        f"lookup >= 3 first, else head p >= {threshold:g}": lookup_first(3),
        "lookup >= 2 unless the head's first p > 0.5": lookup_first(2, keep_head_above=0.5),
        "lookup >= 2 unless the head's first p > 0.3": lookup_first(2, keep_head_above=0.3),
        "lookup >= 2 only where it agrees with the head's first draft": lookup_first(2, agree=True),
        "lookup >= 2 first, else lookup 1 where it agrees with the head's first draft, else head": then_agreeing_single,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="a head folder")
    p.add_argument("--kind", required=True, choices=["medusa", "eagle", "eagle3", "mtp"])
    p.add_argument("--prompts", default="mt-bench", choices=["mt-bench", "humaneval"],
                   help="the demo's prompt sets (MT-bench one per category in turn)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threshold", type=float, default=0.1, help="the head's confidence cut")
    args = p.parse_args(argv)
    prompts = [first_turn(m) for m in load_prompts(args.prompts, args.num_prompts)["messages"]]
    # A threshold too small to cut makes the head report its draft probabilities.
    engine = Engine(DEFAULT_TARGET, max_num_seqs=1, speculative_config=dict(
        method=args.kind, model=args.head, num_speculative_tokens=K, prompt_lookup_first=True, prompt_lookup_min=1,
        confidence_threshold=1e-30))
    steps = record(engine, prompts, args.max_new_tokens)
    print(f"{len(prompts)} {args.prompts} prompts x {args.max_new_tokens} tokens, {len(steps)} steps of {K} drafts\n")
    print("| suffix | steps with a match | lookup's drafts accepted there | head's drafts accepted there |")
    print("|---|---|---|---|")
    for n in SUFFIXES:
        found = [s for s in steps if s["lookup"][n]]
        mean = lambda source: sum(s["accepted"][source] for s in found) / max(len(found), 1)
        print(f"| {n} | {len(found) / len(steps):.2f} | {mean(n):.2f} | {mean('head'):.2f} |")
    print("\n| rule | drafts accepted per step | drafts verified per step | steps the head drafts |")
    print("|---|---|---|---|")
    for name, choose in rules(ChainCut(engine.speculator.drafter.head.head, args.threshold)).items():
        picks = [choose(s) for s in steps]
        num_accepted = sum(min(s["accepted"][source], length) for s, (source, length) in zip(steps, picks))
        print(f"| {name} | {num_accepted / len(steps):.2f} | {sum(length for _, length in picks) / len(steps):.2f} "
              f"| {sum(source == 'head' for source, _ in picks) / len(steps):.2f} |")


if __name__ == "__main__":
    main()
