"""Prompt lookup against a head, step by step: at every step of a head's greedy drafting (concurrency 1, always
num_speculative_tokens drafts), the chain prompt lookup would propose for a suffix of exactly 3, 2 and 1 tokens and
the head's own chain with its draft probabilities, each scored against the greedy output (which no draft changes),
then rules for choosing between them scored on the same steps.

Two more sources, scored on the same steps: with --store, lookup in the target's answers of a self-distilled store
(the chain that most often followed the sequence's last --store-suffix tokens there); and the head's runners-up at
its first draft (ranks 2 and 3 at its calibrated temperature), which a tree would verify beside the chain, each as
one more row whose acceptance adds one token.

The steps are those of the head's run, so a rule's numbers compare rules; its tau in the engine is lower, since a
rule that accepts more also steps over more of the repeated text in one step.

    python benchmarks/lookup_rules.py --head runs/eagle/heads/best --kind eagle [--prompts mt-bench] \
        [--num-prompts 24] [--max-new-tokens 96] [--threshold 0.1] [--store data/demo-smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import serving.drafters.heads as head_drafters
from serving.drafters.heads import ChainCut
from serving.engine import Engine
from serving.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.spec.verify import verify_greedy
from serving.targets import DEFAULT_TARGET

K = 4
SUFFIXES = (3, 2, 1)
RUNNERS_UP = 2  # the head's 2nd and 3rd most likely first drafts


class StoreLookup:
    """For every run of n answer tokens in a store, the K-token chains that followed it, counted."""

    def __init__(self, path: str, n: int):
        from training.data.store import Store

        self.n, self.chains, self.num_tokens = n, defaultdict(Counter), 0
        table = Store(path).table
        for ids, mask in zip(table["input_ids"], table["loss_mask"]):
            answer = [token for token, m in zip(ids, mask) if m]
            self.num_tokens += len(answer)
            for s in range(len(answer) - n):
                self.chains[tuple(answer[s:s + n])][tuple(answer[s + n:s + n + K])] += 1

    def lookup(self, tokens: list[int]) -> list[int]:
        found = self.chains.get(tuple(tokens[-self.n:]))
        return list(found.most_common(1)[0][0]) if found else []


def record(engine, prompts, max_new_tokens, store=None) -> list[dict]:
    drafter = engine.speculator.drafter
    lookup, head = drafter.lookup, drafter.head
    probs, firsts, steps = [], [], []
    keeps, best = head.cut.keeps, head_drafters._best

    def spy_keeps(chain_p, p):
        probs.append(p)
        return keeps(chain_p, p)

    def spy_best(logits, hot, temperature=None, to_ids=None):
        """Also keeps the first draft's runners-up with their probabilities at the draft's temperature."""
        if not firsts:
            ids, probs = head_drafters.ranked_after_best(logits[:1], hot, RUNNERS_UP, temperature or 1.0, to_ids)
            firsts.append((ids[0], probs[0]))
        return best(logits, hot, temperature, to_ids)

    def propose(engine_, requests, budgets, step):
        drafts = {}
        for r in requests:
            found = {}
            for n in SUFFIXES:
                lookup.min_n = lookup.max_n = n
                found[n] = lookup.lookup(r.token_ids, budgets[r.request_id])
            if store is not None:
                found["store"] = store.lookup(r.token_ids)
            probs.clear()
            firsts.clear()
            budget = {r.request_id: budgets[r.request_id]}
            drafts[r.request_id] = head.propose(engine_, [r], budget, step).get(r.request_id, [])
            if budgets[r.request_id] == K and firsts:
                steps.append(dict(request_id=r.request_id, start=len(r.token_ids), lookup=found,
                                  head=drafts[r.request_id], probs=probs[:len(drafts[r.request_id])],
                                  runners_up=firsts[0]))
        return drafts

    head.cut.keeps, drafter.propose, head_drafters._best = spy_keeps, propose, spy_best
    finals = {}
    try:
        for prompt in prompts:
            [out] = engine.generate([prompt], SamplingParams(max_tokens=max_new_tokens))
            finals[out.request_id] = out.prompt_token_ids + out.token_ids
    finally:
        head_drafters._best = best
    for s in steps:
        final = finals[s["request_id"]]
        # the greedy output's tokens after the step's start, and a sentinel past its end, as the target's choices
        s["accepted"] = {source: verify_greedy(final[s["start"]:s["start"] + len(chain)] + [None], chain)[0]
                         for source, chain in [("head", s["head"])] + list(s["lookup"].items())}
        s["next"] = final[s["start"]] if s["start"] < len(final) else None
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


def rules(cut: ChainCut, with_store: bool = False) -> dict:
    """name -> step -> (source, number of drafts verified); source is "head", a suffix length or "store"."""
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

    def then_store(s):
        """lookup >= 2 first; else the store's chain; else the head."""
        source, length = lookup_first(2)(s)
        if source == "head" and s["lookup"].get("store"):
            return "store", len(s["lookup"]["store"])
        return source, length

    threshold = cut.threshold
    chosen = {
        f"head, p >= {threshold:g}": lambda s: ("head", cut_length(s["probs"], cut)),
        f"lookup >= 1 first, else head p >= {threshold:g}": lookup_first(1),
        f"lookup >= 2 first, else head p >= {threshold:g} (prompt_lookup_first)": lookup_first(2),
        f"lookup >= 3 first, else head p >= {threshold:g}": lookup_first(3),
        "lookup >= 2 unless the head's first p > 0.5": lookup_first(2, keep_head_above=0.5),
        "lookup >= 2 unless the head's first p > 0.3": lookup_first(2, keep_head_above=0.3),
        "lookup >= 2 only where it agrees with the head's first draft": lookup_first(2, agree=True),
        "lookup >= 2 first, else lookup 1 where it agrees with the head's first draft, else head": then_agreeing_single,
    }
    if with_store:
        chosen["the store's chain alone"] = lambda s: ("store", len(s["lookup"]["store"]))
        chosen[f"lookup >= 2 first, else the store's chain, else head p >= {threshold:g}"] = then_store
    return chosen


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="a head folder")
    p.add_argument("--kind", required=True, choices=["medusa", "eagle", "eagle3", "mtp"])
    p.add_argument("--prompts", default="mt-bench", choices=["mt-bench", "humaneval"],
                   help="the demo's prompt sets (MT-bench one per category in turn)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threshold", type=float, default=0.1, help="the head's confidence cut")
    p.add_argument("--store", help="also look up in this self-distilled store's answers (the head's training data)")
    p.add_argument("--store-suffix", type=int, default=3, help="tokens of the sequence's end looked up in the store")
    args = p.parse_args(argv)
    store = StoreLookup(args.store, args.store_suffix) if args.store else None
    prompts = [first_turn(m) for m in load_prompts(args.prompts, args.num_prompts)["messages"]]
    # A threshold too small to cut makes the head report its draft probabilities.
    engine = Engine(DEFAULT_TARGET, max_num_seqs=1, speculative_config=dict(
        method=args.kind, model=args.head, num_speculative_tokens=K, prompt_lookup_first=True, prompt_lookup_min=1,
        confidence_threshold=1e-30))
    steps = record(engine, prompts, args.max_new_tokens, store)
    print(f"{len(prompts)} {args.prompts} prompts x {args.max_new_tokens} tokens, {len(steps)} steps of {K} drafts"
          + (f"; store lookup over {store.num_tokens:,} answer tokens, suffix {store.n}" if store else "") + "\n")
    print("| suffix | steps with a match | lookup's drafts accepted there | head's drafts accepted there |")
    print("|---|---|---|---|")
    for n in SUFFIXES:
        found = [s for s in steps if s["lookup"][n]]
        mean = lambda source: sum(s["accepted"][source] for s in found) / max(len(found), 1)
        print(f"| {n} | {len(found) / len(steps):.2f} | {mean(n):.2f} | {mean('head'):.2f} |")
    print("\n| rule | drafts accepted per step | drafts verified per step | steps the head drafts |")
    print("|---|---|---|---|")
    for name, choose in rules(ChainCut(engine.speculator.drafter.head.head, args.threshold), store is not None).items():
        picks = [choose(s) for s in steps]
        num_accepted = sum(min(s["accepted"][source], length) for s, (source, length) in zip(steps, picks))
        print(f"| {name} | {num_accepted / len(steps):.2f} | {sum(length for _, length in picks) / len(steps):.2f} "
              f"| {sum(source == 'head' for source, _ in picks) / len(steps):.2f} |")
    runners_up(steps)


def runners_up(steps: list[dict]) -> None:
    """Where the target's next token ranks among the head's first drafts, and what verifying the runners-up as
    leaves beside the chain would add: one token for each one the target picks, one row for each verified."""
    scored = [s for s in steps if s["next"] is not None]
    ranks = Counter(1 if s["head"] and s["head"][0] == s["next"] else
                    2 + s["runners_up"][0].index(s["next"]) if s["next"] in s["runners_up"][0] else None for s in scored)
    print("\n| the target's next token is the head's | 1st | 2nd | 3rd | none of these |")
    print("|---|---|---|---|---|")
    print(f"| share of {len(scored)} steps | " + " | ".join(f"{ranks[r] / len(scored):.3f}" for r in (1, 2, 3, None)) + " |")
    print("\n| runners-up verified | tokens added per step | rows added per step |")
    print("|---|---|---|")
    for floor in (0.0, 0.05, 0.1, 0.2):
        added = rows = 0
        for s in scored:
            kept = [token for token, p in zip(*s["runners_up"]) if p >= floor]
            rows += len(kept)
            added += s["next"] in kept
        print(f"| those with p >= {floor:g} | {added / len(scored):.3f} | {rows / len(scored):.2f} |")


if __name__ == "__main__":
    main()
