"""Block verification of sampled chains (`rejection_sample_method: "block"`, serving/spec_decode/verify.py).

1. Exact laws by enumeration on toy models (explicit p and q for every prefix, vocabularies of 2 to 4, chains of 2
   to 3 drafts): summing over every drafted chain, every accepted length and every next token, the law of the
   emitted tokens (completed by the target to a fixed length) is the target's joint law to 1e-9, for drafts sampled
   from q and for deterministic drafts; the standard residual in the block rule's place is not (the check can fail).
   The expected accepted length is >= token-by-token verification's on random toys, equal for deterministic drafts
   (their bound), and on the paper's motivating example (binary vocabulary, target (1/3, 2/3), drafter (2/3, 1/3),
   2 drafts) exactly 11/9 against 10/9.
2. `verify_block` itself: its accepted-length frequencies over seeded draws follow the exact law of 1. (TV 0.03 on 4
   cells, 20,000 draws on the paper's example with 3 drafts; mean within 4 standard errors), and the first three emitted tokens follow the target's law
   within TV 0.07 (12,000 draws over 125 cells) at temperature 0.8 with top-k 4 and at temperature 1. Expected
   accepted lengths of both rules, exact by enumeration (chains of 2 to 4, random and spread-out q, and q the
   target's own logits at draft temperature 1.5): block >= token by token exactly, and verify_block's and
   verify_sampled's means over seeded draws within 4 standard errors of them; `expected_accepted`, the two rules'
   expectations given one drafted chain, averages to both exactly.
3. Through the engine: greedy requests with block on reproduce plain greedy decoding and never reach verify_block;
   a draft model sampling at temperature 3 for requests at 0.7 (20,000 seeded requests, 2 drafts after the
   prefill's token): every emitted position's marginal is the target's (TV < 0.05, as test_spec's) and the first
   verify step's accepted counts follow the exact block law computed from transformers' p and q (TV < 0.02, mean
   within 3 standard errors), whose mean exceeds the standard rule's by more than 5 standard errors. Over whole
   generations, every chain verify_block gets carries q = softmax(draft logits / draft_temperature) after its
   prefixes (transformers' logits), the law its drafts were drawn from (uniform randomized PIT values), and p from
   the target's logits.
4. Config: vLLM's name and values, "synthetic" and unknown values refused clearly, a warning for configs that draft
   trees, and trees still verified by the standard rules.
"""
from __future__ import annotations

import itertools
import math
import warnings
from fractions import Fraction

import pytest
import torch

from serving.drafters.base import Drafter
from serving.request import SamplingParams
from serving.sampler import sample, target_probs
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.tree import DraftTree
from serving.spec_decode.verify import expected_accepted, verify_block, verify_sampled

from engine_helpers import assert_pool_idle, make_engine, plain_outputs, random_prompts
from test_spec import exact_marginals, last_logits, tv


# ---- 1. exact laws by enumeration --------------------------------------------------------------------------


class Toy:
    """A target p and a drafter q over a small vocabulary: one explicit law per prefix (a tuple of tokens), drawn
    once from a seeded generator, or given as `fixed` (the same law after every prefix). `q_scale` scales q's logits
    (below 1: q spread out); `draft_temperature` makes q the softmax of p's own logits at that temperature (the
    target drafting for itself, as draft_model with draft_temperature does)."""

    def __init__(self, vocab: int, seed: int = 0, params: SamplingParams | None = None, fixed=None,
                 q_scale: float = 1.0, draft_temperature: float | None = None):
        self.vocab, self.params, self.fixed = vocab, params or SamplingParams(temperature=1.0), fixed
        self.q_scale, self.draft_temperature = q_scale, draft_temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.logits: dict = {}
        self.laws: dict = {}

    def _logits(self, who: str, prefix: tuple) -> torch.Tensor:
        key = ("p" if self.draft_temperature else who, prefix)
        if key not in self.logits:
            self.logits[key] = 2.0 * torch.randn(1, self.vocab, generator=self.generator)
        return self.logits[key]

    def _law(self, who: str, prefix: tuple) -> list:
        if self.fixed is not None:
            return list(self.fixed[who])
        if (who, prefix) not in self.laws:
            logits = self._logits(who, prefix)
            if who == "p":
                law = target_probs(logits, self.params)[0]
            else:
                law = torch.softmax(logits[0] / self.draft_temperature if self.draft_temperature
                                    else self.q_scale * logits[0], -1)
            law = law.double()
            self.laws[who, prefix] = (law / law.sum()).tolist()  # exact to float64 rounding
        return self.laws[who, prefix]

    def p(self, prefix: tuple) -> list:
        return self._law("p", tuple(prefix))

    def q(self, prefix: tuple) -> list:
        return self._law("q", tuple(prefix))


def one_hot(token: int, vocab: int) -> list:
    return [1.0 if t == token else 0.0 for t in range(vocab)]


def block_outcomes(p_rows, q_rows, chain, standard_residual: bool = False):
    """The block rule of Sun et al. 2024 written out for one drafted chain of k tokens, p_rows[i] / q_rows[i] the
    target's / drafter's law at depth i + 1 (p_rows has k + 1 rows): [(probability, accepted length, law of the
    next token)]. `standard_residual` draws the next token from max(p - q, 0) instead (a wrong rule)."""
    k = len(chain)
    weights = [1.0]
    for i, x in enumerate(chain):
        ratio = weights[-1] * p_rows[i][x] / q_rows[i][x] if q_rows[i][x] > 0 else float(weights[-1] * p_rows[i][x] > 0)
        weights.append(min(1.0, ratio))

    def residual(i):
        scale = 1.0 if standard_residual else weights[i]
        return [max(scale * pp - qq, 0.0) for pp, qq in zip(p_rows[i], q_rows[i])]

    accepts = []
    for i in range(1, k + 1):
        if i < k:
            mass = sum(residual(i))
            accepts.append(mass / (mass + 1 - weights[i]) if mass + 1 - weights[i] > 0 else 1.0)
        else:
            accepts.append(weights[k])
    outcomes = []
    for tau in range(k + 1):  # the deepest accepted depth is tau: accepted there, rejected below it
        prob = (accepts[tau - 1] if tau else 1.0) * math.prod(1 - a for a in accepts[tau:])
        if tau == k:
            law = p_rows[k]
        else:
            law = residual(tau)
            total = sum(law)
            law = [x / total for x in law] if total > 0 else p_rows[tau]
        outcomes.append((prob, tau, law))
    return outcomes


def enumerate_block(toy: Toy, k: int, deterministic: list | None = None, standard_residual: bool = False):
    """Exact (law of the first k + 1 emitted tokens, law of the accepted length) of block verification on `toy`,
    the chain drawn from q, or the fixed chain `deterministic` (q one-hot). After a rejection the target draws the
    tokens up to k + 1, as the next steps would."""
    vocab = toy.vocab
    joint = torch.zeros((vocab,) * (k + 1), dtype=torch.float64)
    accepted = torch.zeros(k + 1, dtype=torch.float64)
    chains = [tuple(deterministic)] if deterministic else itertools.product(range(vocab), repeat=k)
    for chain in chains:
        p_rows = [toy.p(chain[:i]) for i in range(k + 1)]
        q_rows = ([one_hot(x, vocab) for x in chain] if deterministic else [toy.q(chain[:i]) for i in range(k)])
        chain_prob = 1.0 if deterministic else math.prod(q_rows[i][x] for i, x in enumerate(chain))
        for prob, tau, law in block_outcomes(p_rows, q_rows, chain, standard_residual):
            accepted[tau] += chain_prob * prob
            for y, py in enumerate(law):
                head = chain[:tau] + (y,)
                for tail in itertools.product(range(vocab), repeat=k - tau):  # the target completes it
                    seq, weight = head + tail, chain_prob * prob * py
                    for i in range(tau + 1, k + 1):
                        weight *= toy.p(seq[:i])[seq[i]]
                    joint[seq] += weight
    return joint, accepted


def target_joint(toy: Toy, k: int) -> torch.Tensor:
    joint = torch.zeros((toy.vocab,) * (k + 1), dtype=torch.float64)
    for seq in itertools.product(range(toy.vocab), repeat=k + 1):
        joint[seq] = math.prod(toy.p(seq[:i])[seq[i]] for i in range(k + 1))
    return joint


def standard_mean(toy: Toy, k: int, deterministic: list | None = None) -> float:
    """Token-by-token verification's expected accepted length: sum_i P(the first i drafts accepted), each draft x
    accepted with min(1, p(x) / q(x)), so drafted and accepted with min(p(x), q(x))."""
    if deterministic:
        return sum(math.prod(toy.p(deterministic[:j])[deterministic[j]] for j in range(i)) for i in range(1, k + 1))
    total = 0.0
    for i in range(1, k + 1):
        for prefix in itertools.product(range(toy.vocab), repeat=i):
            total += math.prod(min(toy.p(prefix[:j])[x], toy.q(prefix[:j])[x]) for j, x in enumerate(prefix))
    return total


def mean(accepted: torch.Tensor) -> float:
    return float((accepted * torch.arange(len(accepted))).sum())


TOYS = [(3, 3, 0, 1.0, 0), (4, 2, 1, 0.8, 3), (2, 3, 2, 1.0, 0)]  # vocab, drafts, seed, temperature, top-k


@pytest.mark.parametrize("vocab, k, seed, temperature, top_k", TOYS)
def test_enumerated_block_law_is_the_targets_and_accepts_at_least_standards(vocab, k, seed, temperature, top_k):
    toy = Toy(vocab, seed, SamplingParams(temperature=temperature, top_k=top_k))
    joint, accepted = enumerate_block(toy, k)
    torch.testing.assert_close(joint, target_joint(toy, k), atol=1e-9, rtol=0)
    assert abs(float(accepted.sum()) - 1) < 1e-9
    block, standard = mean(accepted), standard_mean(toy, k)
    assert block >= standard - 1e-12, (block, standard)
    wrong, _ = enumerate_block(toy, k, standard_residual=True)
    assert float((wrong - target_joint(toy, k)).abs().sum()) > 1e-3, "the exactness check must be able to fail"


@pytest.mark.parametrize("vocab, k, seed", [(3, 3, 0), (4, 2, 1)])
def test_deterministic_drafts_accept_as_standard_verification_does(vocab, k, seed):
    """q one-hot: block verification keeps the target's law and accepts the prefix x_1..x_i with its probability under
    p, the bound of every exact verifier, which token-by-token verification reaches too."""
    toy = Toy(vocab, seed)
    chain = [int(torch.tensor(toy.p(())).argmax())]
    while len(chain) < k:
        chain.append(int(torch.tensor(toy.p(tuple(chain))).argmin()) if len(chain) == 1 else 0)
    joint, accepted = enumerate_block(toy, k, deterministic=chain)
    torch.testing.assert_close(joint, target_joint(toy, k), atol=1e-9, rtol=0)
    assert abs(mean(accepted) - standard_mean(toy, k, deterministic=chain)) < 1e-12


def test_the_papers_example_accepts_11_9_against_10_9():
    """Sun et al.'s motivating example: context-free target (1/3, 2/3) and drafter (2/3, 1/3), two drafts."""
    toy = Toy(2, fixed={"p": [1 / 3, 2 / 3], "q": [2 / 3, 1 / 3]})
    _, accepted = enumerate_block(toy, 2)
    assert abs(standard_mean(toy, 2) - float(Fraction(10, 9))) < 1e-12
    assert abs(mean(accepted) - float(Fraction(11, 9))) < 1e-12


def exact_accepted_laws(toy: Toy, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact laws of the accepted count (0..k) of a chain of k drafts drawn from toy's q: (token by token, block).
    Token by token from survivals, P(the first i drafts accepted) = sum over i-token prefixes of prod min(p, q),
    a formula of its own; block from the paper's rule written out (block_outcomes), every chain enumerated."""
    survival = [1.0] + [sum(math.prod(min(toy.p(prefix[:j])[x], toy.q(prefix[:j])[x]) for j, x in enumerate(prefix))
                            for prefix in itertools.product(range(toy.vocab), repeat=i)) for i in range(1, k + 1)]
    standard = torch.tensor([survival[i] - (survival[i + 1] if i < k else 0.0) for i in range(k + 1)],
                            dtype=torch.float64)
    block = torch.zeros(k + 1, dtype=torch.float64)
    for chain in itertools.product(range(toy.vocab), repeat=k):
        p_rows, q_rows = [toy.p(chain[:i]) for i in range(k + 1)], [toy.q(chain[:i]) for i in range(k)]
        chain_prob = math.prod(q_rows[i][x] for i, x in enumerate(chain))
        for prob, tau, _ in block_outcomes(p_rows, q_rows, chain):
            block[tau] += chain_prob * prob
    return standard, block


def expected_over_chains(toy: Toy, k: int) -> tuple[float, float]:
    """`expected_accepted` averaged exactly over the chains q draws: each rule's expected accepted count."""
    standard = block = 0.0
    for chain in itertools.product(range(toy.vocab), repeat=k):
        q_rows = torch.tensor([toy.q(chain[:i]) for i in range(k)], dtype=torch.float64)
        probs = torch.tensor([toy.p(chain[:i]) for i in range(k + 1)], dtype=torch.float64)
        chain_prob = math.prod(float(q_rows[i, x]) for i, x in enumerate(chain))
        one, other = expected_accepted(DraftTree.chain(chain, q_rows), probs)
        standard, block = standard + chain_prob * one, block + chain_prob * other
    return standard, block


def spread(law: torch.Tensor, num: int) -> float:
    """The standard error of the mean of `num` draws from `law` (over 0, 1, ...)."""
    values = torch.arange(len(law), dtype=torch.float64)
    return math.sqrt(float((law * (values - mean(law)) ** 2).sum()) / num)


# vocab, drafts, seed, target temperature, q: ("scale", s) q's own logits times s, ("draft_temperature", t) p's logits
# at t (the benchmark's self-drafting case). Spread-out q, where the rules differ, in every case but the first.
EXPECTATION_TOYS = [(3, 2, 5, 1.0, ("scale", 1.0)), (4, 3, 6, 1.0, ("scale", 0.3)), (3, 4, 7, 0.7, ("scale", 0.5)),
                    (4, 4, 8, 0.7, ("draft_temperature", 1.5)), (3, 4, 9, 1.0, ("draft_temperature", 1.5))]


@pytest.mark.parametrize("vocab, k, seed, temperature, q", EXPECTATION_TOYS)
def test_both_verifiers_accept_their_exact_expected_lengths_and_block_is_never_below(vocab, k, seed, temperature, q):
    """Chains of 2 to 4 drafts on toys of 3 or 4 tokens: the exact expected accepted lengths of both rules by
    enumeration, block >= token by token exactly, verify_block's and verify_sampled's empirical means over 6,000
    seeded chains each within 4 standard errors of them, and their difference too; `expected_accepted` (the
    benchmark's noise-free per-step estimate) averages exactly to both and, on the same draws, to within 4 of its
    own (smaller) standard errors."""
    options = {"q_scale": q[1]} if q[0] == "scale" else {"draft_temperature": q[1]}
    toy = Toy(vocab, seed, SamplingParams(temperature=temperature), **options)
    standard_law, block_law = exact_accepted_laws(toy, k)
    standard, block = mean(standard_law), mean(block_law)
    assert abs(float(standard_law.sum()) - 1) < 1e-9 and abs(float(block_law.sum()) - 1) < 1e-9
    assert abs(standard - standard_mean(toy, k)) < 1e-12
    assert block >= standard - 1e-12, (block, standard)
    if q != ("scale", 1.0):
        assert block > standard + 0.01, "q spread out: the toy separates the two rules"
    expected = expected_over_chains(toy, k)
    assert abs(expected[0] - standard) < 1e-9 and abs(expected[1] - block) < 1e-9, (expected, standard, block)

    num = 6_000
    draft_g, block_g, standard_g = (torch.Generator().manual_seed(seed * 10 + s) for s in range(3))
    block_counts, standard_counts, paired = torch.zeros(k + 1), torch.zeros(k + 1), []
    for _ in range(num):
        chain, probs = draw_chain(toy, k, draft_g)
        block_counts[len(verify_block(chain, probs, block_g)[0])] += 1
        standard_counts[len(verify_sampled(chain, probs, standard_g)[0])] += 1
        paired.append(expected_accepted(chain, probs))
    values = torch.arange(k + 1, dtype=torch.float64)
    block_mean = float((block_counts.double() * values).sum()) / num
    standard_mean_drawn = float((standard_counts.double() * values).sum()) / num
    block_se, standard_se = spread(block_law, num), spread(standard_law, num)
    assert abs(block_mean - block) < 4 * block_se, (block_mean, block, block_se)
    assert abs(standard_mean_drawn - standard) < 4 * standard_se, (standard_mean_drawn, standard, standard_se)
    difference_se = math.hypot(block_se, standard_se)
    assert abs((block_mean - standard_mean_drawn) - (block - standard)) < 4 * difference_se
    paired = torch.tensor(paired, dtype=torch.float64)
    gaps = paired[:, 1] - paired[:, 0]
    gap_se = float(gaps.std()) / math.sqrt(num)
    assert abs(float(gaps.mean()) - (block - standard)) < 4 * gap_se + 1e-6, (float(gaps.mean()), block - standard)
    assert gap_se < difference_se / 2, "the paired estimate is the less noisy one"


# ---- 2. verify_block's draws ---------------------------------------------------------------------------------


def draw_chain(toy: Toy, k: int, generator: torch.Generator) -> tuple[DraftTree, torch.Tensor]:
    """A chain drawn from toy's q, and the target's rows after each of its prefixes ([k + 1, vocab])."""
    tokens, q_rows = [], []
    for _ in range(k):
        q = torch.tensor(toy.q(tuple(tokens)), dtype=torch.float32)
        q_rows.append(q)
        tokens.append(sample(q, generator))
    probs = torch.tensor([toy.p(tuple(tokens[:i])) for i in range(k + 1)], dtype=torch.float32)
    return DraftTree.chain(tokens, torch.stack(q_rows)), probs


def complete(toy: Toy, emitted: list, length: int, generator: torch.Generator) -> tuple:
    """The emitted tokens, continued by the target up to `length` (as the next steps would)."""
    out = list(emitted)
    while len(out) < length:
        out.append(sample(torch.tensor(toy.p(tuple(out))), generator))
    return tuple(out[:length])


@pytest.mark.parametrize("temperature, top_k", [(0.8, 4), (1.0, 0)], ids=["T0.8-top4", "T1"])
def test_block_verification_keeps_the_target_law(temperature, top_k):
    k, vocab, num = 3, 5, 12_000
    toy = Toy(vocab, seed=4, params=SamplingParams(temperature=temperature, top_k=top_k))
    draft_g, verify_g, fill_g = (torch.Generator().manual_seed(s) for s in (1, 2, 3))
    counts = torch.zeros((vocab,) * k)
    lengths = torch.zeros(k + 1)
    for _ in range(num):
        chain, probs = draw_chain(toy, k, draft_g)
        path, emitted = verify_block(chain, probs, verify_g)
        assert path == list(range(len(path))) and emitted[:len(path)] == list(chain.tokens[:len(path)])
        assert len(emitted) == len(path) + 1
        lengths[len(path)] += 1
        counts[complete(toy, emitted, k, fill_g)] += 1
    law = target_joint(toy, k - 1)
    distance = tv(counts.flatten(), law.flatten())
    assert distance <= 0.07, f"TV {distance:.4f} between the emitted triples and the target law"
    assert all(lengths), f"every accepted length occurs: {lengths.tolist()}"


def test_block_acceptance_frequencies_follow_the_exact_law():
    """On the paper's example with 3 drafts, where the two rules' means differ by far more than the noise."""
    k, num = 3, 20_000
    toy = Toy(2, fixed={"p": [1 / 3, 2 / 3], "q": [2 / 3, 1 / 3]})
    _, exact = enumerate_block(toy, k)
    draft_g, verify_g = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    lengths = torch.zeros(k + 1)
    for _ in range(num):
        chain, probs = draw_chain(toy, k, draft_g)
        lengths[len(verify_block(chain, probs, verify_g)[0])] += 1
    assert tv(lengths, exact) < 0.03, (lengths / num, exact)
    empirical = float((lengths * torch.arange(k + 1)).sum()) / num
    spread = math.sqrt(float((exact * (torch.arange(k + 1) - mean(exact)) ** 2).sum()) / num)
    assert abs(empirical - mean(exact)) < 4 * spread, (empirical, mean(exact), spread)
    assert mean(exact) > standard_mean(toy, k) + 8 * spread, "the toy separates the two rules"


def test_block_verification_refuses_trees():
    with pytest.raises(ValueError, match="takes a chain"):
        verify_block(DraftTree((1, 2), (-1, -1)), torch.full((3, 4), 0.25), torch.Generator())


# ---- 3. through the engine ------------------------------------------------------------------------------------


def test_greedy_requests_with_block_on_reproduce_plain_greedy(tiny_llama, monkeypatch):
    import serving.spec_decode.speculator as speculator

    def never(*args):
        raise AssertionError("greedy requests verify greedily")

    monkeypatch.setattr(speculator, "verify_block", never)
    prompts = random_prompts([5, 17, 30], seed=3)
    prompts = [p + p for p in prompts]  # repeats for n-gram to find
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                      "rejection_sample_method": "block"}, max_model_len=256)
    outputs = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs == plain_outputs(tiny_llama, prompts, params, max_model_len=256)
    assert sum(engine.speculator.stats.proposed) > 0
    assert_pool_idle(engine)


def exact_first_verify_block(target_hf, draft_hf, prompt, params, draft_temperature, vocab=8) -> torch.Tensor:
    """Law of the accepted count (0, 1, 2) of the first verify step (2 drafts after the prefill's x1) under block
    verification, q = softmax(draft logits / draft_temperature), p from transformers through target_probs."""
    p1 = target_probs(last_logits(target_hf, [prompt]), params)[0].double()
    law = torch.zeros(3, dtype=torch.float64)
    for x1 in range(vocab):
        ctx = [prompt + [x1]]
        pa = target_probs(last_logits(target_hf, ctx), params)[0].double().tolist()
        qa = torch.softmax(last_logits(draft_hf, ctx)[0] / draft_temperature, -1).double().tolist()
        ctx2 = [prompt + [x1, d1] for d1 in range(vocab)]
        pb = target_probs(last_logits(target_hf, ctx2), params).double().tolist()
        qb = torch.softmax(last_logits(draft_hf, ctx2) / draft_temperature, -1).double().tolist()
        for d1, d2 in itertools.product(range(vocab), repeat=2):
            chain_prob = qa[d1] * qb[d1][d2]
            for prob, tau, _ in block_outcomes([pa, pb[d1], pb[d1]], [qa, qb[d1]], (d1, d2)):
                law[tau] += float(p1[x1]) * chain_prob * prob
    return law


def exact_first_verify_standard(target_hf, draft_hf, prompt, params, draft_temperature, vocab=8) -> torch.Tensor:
    """The same law under token-by-token verification: each draft drafted and accepted with min(p, q)."""
    p1 = target_probs(last_logits(target_hf, [prompt]), params)[0].double()
    one = two = 0.0
    for x1 in range(vocab):
        ctx = [prompt + [x1]]
        pa = target_probs(last_logits(target_hf, ctx), params)[0].double()
        qa = torch.softmax(last_logits(draft_hf, ctx)[0] / draft_temperature, -1).double()
        ctx2 = [prompt + [x1, d1] for d1 in range(vocab)]
        pb = target_probs(last_logits(target_hf, ctx2), params).double()
        qb = torch.softmax(last_logits(draft_hf, ctx2) / draft_temperature, -1).double()
        first, second = torch.minimum(pa, qa), torch.minimum(pb, qb).sum(-1)
        one += float(p1[x1] * first.sum())
        two += float(p1[x1] * (first * second).sum())
    return torch.tensor([1 - one, one - two, two], dtype=torch.float64)


def test_sampled_law_is_the_target_law_with_block_verification(v8_target, v8_draft):
    from transformers import AutoModelForCausalLM

    # drafts far flatter than the target (draft temperature 3): where the two rules' accepted counts differ most on
    # this pair of models, by 0.03 in the mean, which 20,000 requests resolve to 6 standard errors
    temperature, draft_temperature, num, depth, prompt = 0.7, 3.0, 20_000, 4, [3, 5]
    spec = {"method": "draft_model", "model": str(v8_draft), "num_speculative_tokens": 2,
            "draft_temperature": draft_temperature, "rejection_sample_method": "block"}
    engine = make_engine(v8_target, spec, block_size=4, num_blocks=4096, max_model_len=64, max_num_seqs=128,
                         max_num_batched_tokens=8192)
    first_verify = {}
    record = engine.speculator.record

    def spy(request, tree, path, num_emitted):
        first_verify.setdefault(request.request_id, (len(tree), len(path)))
        record(request, tree, path, num_emitted)

    engine.speculator.record = spy
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=depth, ignore_eos=True) for i in range(num)]
    outputs = engine.generate([prompt] * num, params)
    assert_pool_idle(engine)
    assert all(first_verify[o.request_id][0] == 2 for o in outputs)

    target_hf = AutoModelForCausalLM.from_pretrained(v8_target, dtype=torch.float32).eval()
    draft_hf = AutoModelForCausalLM.from_pretrained(v8_draft, dtype=torch.float32).eval()
    laws = exact_marginals(target_hf, prompt, params[0], depth)
    tokens = torch.tensor([o.token_ids for o in outputs])
    distances = [tv(torch.bincount(tokens[:, j], minlength=8), laws[j]) for j in range(depth)]
    assert max(distances) < 0.05, f"TV per generated position {distances}"
    block_law = exact_first_verify_block(target_hf, draft_hf, prompt, params[0], draft_temperature)
    standard_law = exact_first_verify_standard(target_hf, draft_hf, prompt, params[0], draft_temperature)
    counts = torch.bincount(torch.tensor([first_verify[o.request_id][1] for o in outputs]), minlength=3)
    assert tv(counts, block_law) < 0.02, (counts.tolist(), block_law.tolist())
    empirical = float((counts * torch.arange(3)).sum()) / num
    spread = math.sqrt(float((block_law * (torch.arange(3) - mean(block_law)) ** 2).sum()) / num)
    assert abs(empirical - mean(block_law)) < 3 * spread, (empirical, mean(block_law), spread)
    assert mean(block_law) - mean(standard_law) > 5 * spread, "the test tells the two rules apart"
    assert float(laws[0].max()) > 0.2


@pytest.fixture(scope="module")
def v8_draft(tmp_path_factory):
    from serving.targets import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("v8_draft"), "llama", seed=1, vocab_size=8, initializer_range=0.3)


def test_the_engine_hands_verify_block_the_law_its_drafts_were_drawn_from(v8_target, v8_draft, monkeypatch):
    """Every verify step of whole generations (the draft model's pool caught up over accepted drafts, rejected ones
    overwritten), draft_model at draft_temperature 1.7 for requests at temperature 0.7 with top-k 6: each chain's q
    rows are softmax(draft logits / 1.7) from transformers after the chain's prefixes (the drafter's temperature,
    not the request's, and no top-k), its p rows target_probs of the target's logits there, and the drafts are draws
    from those q rows (their randomized PIT values are uniform: Kolmogorov-Smirnov distance below its 1% level)."""
    from transformers import AutoModelForCausalLM

    import serving.spec_decode.speculator as speculator

    draft_temperature, num, k = 1.7, 200, 3
    spec = {"method": "draft_model", "model": str(v8_draft), "num_speculative_tokens": k,
            "draft_temperature": draft_temperature, "rejection_sample_method": "block"}
    engine = make_engine(v8_target, spec, block_size=4, max_model_len=64, max_num_seqs=32)
    steps, contexts = [], {}
    verify = engine.speculator.verify

    def verify_spy(request, logits, best):
        contexts["now"] = list(request.token_ids)  # the newest token last: row 0 is the law after it
        return verify(request, logits, best)

    def block_spy(chain, probs, generator):
        steps.append((contexts["now"], chain, probs.clone()))
        return verify_block(chain, probs, generator)

    engine.speculator.verify = verify_spy
    monkeypatch.setattr(speculator, "verify_block", block_spy)
    params = [SamplingParams(temperature=0.7, top_k=6, seed=i, max_tokens=16, ignore_eos=True) for i in range(num)]
    engine.generate(random_prompts([3, 6, 9, 12] * (num // 4), seed=5, vocab=8), params)
    assert_pool_idle(engine)
    assert len(steps) > 5 * num and sum(len(chain) == k for _, chain, _ in steps) > 3 * num

    target_hf = AutoModelForCausalLM.from_pretrained(v8_target, dtype=torch.float32).eval()
    draft_hf = AutoModelForCausalLM.from_pretrained(v8_draft, dtype=torch.float32).eval()
    pit_g, pits = torch.Generator().manual_seed(0), []
    with torch.no_grad():
        for context, chain, probs in steps:
            ids = torch.tensor([context + list(chain.tokens)])
            rows = slice(len(context) - 1, len(context) + len(chain))
            draft_q = torch.softmax(draft_hf(ids).logits[0, rows][:-1].float() / draft_temperature, -1)
            target_p = target_probs(target_hf(ids).logits[0, rows].float(), params[0])
            torch.testing.assert_close(chain.q, draft_q, atol=2e-5, rtol=0)
            torch.testing.assert_close(probs, target_p, atol=2e-5, rtol=0)
            for q, token in zip(chain.q.double(), chain.tokens):
                below = float(q[:token].sum())
                pits.append(below + float(torch.rand((), generator=pit_g, dtype=torch.float64)) * float(q[token]))
    pits = torch.tensor(sorted(pits), dtype=torch.float64)
    n = len(pits)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    distance = float(torch.maximum(ranks / n - pits, pits - (ranks - 1) / n).max())
    assert distance < 1.63 / math.sqrt(n), (distance, n)


def test_block_beats_standard_on_the_engines_first_verify(v8_target, v8_draft):
    """The exact law above accepts more in expectation than the standard rule on the same models (so the engine
    test compares against a law that differs from the standard one)."""
    from transformers import AutoModelForCausalLM

    from test_spec import exact_first_verify

    target_hf = AutoModelForCausalLM.from_pretrained(v8_target, dtype=torch.float32).eval()
    draft_hf = AutoModelForCausalLM.from_pretrained(v8_draft, dtype=torch.float32).eval()
    params = SamplingParams(temperature=1.0)
    block = exact_first_verify_block(target_hf, draft_hf, [3, 5], params, 1.0)
    standard = exact_first_verify(target_hf, draft_hf, [3, 5], params, greedy_draft=False)
    assert abs(float(block.sum()) - 1) < 1e-6  # p and q in float32
    assert mean(block) > mean(standard) + 1e-4, (block.tolist(), standard.tolist())


# ---- 4. config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("synthetic", "'synthetic' is vLLM's benchmarking mode"),
    ("blocks", r"rejection_sample_method='blocks' is unknown; choose one of standard, block"),
])
def test_bad_rejection_sample_methods_are_clear_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json({"method": "ngram", "rejection_sample_method": value})


def test_block_with_trees_warns_and_chains_do_not():
    with pytest.warns(UserWarning, match="verifies chains; 'suffix' with this config drafts trees"):
        SpeculativeConfig.from_json({"method": "suffix", "rejection_sample_method": "block"})
    with pytest.warns(UserWarning, match="drafts trees"):
        SpeculativeConfig(method="eagle", model="x", topk=2, rejection_sample_method="block")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = SpeculativeConfig(method="ngram", rejection_sample_method="block")
    assert config.label().endswith(" block") and SpeculativeConfig(method="ngram").rejection_sample_method == "standard"


class ChainsAndTrees(Drafter):
    """Proposes, in turn, a chain of 3 random tokens and a tree of 3 (two children of the newest token, one below
    the first)."""

    def __init__(self):
        self.generator, self.turn = torch.Generator().manual_seed(0), 0

    def propose(self, ctx, requests, budgets):
        self.turn += 1
        parents = (-1, 0, 1) if self.turn % 2 else (-1, -1, 0)
        return {r.request_id: DraftTree(torch.randint(8, (3,), generator=self.generator).tolist(), parents)
                for r in requests if budgets[r.request_id].num_nodes >= 3}


def test_trees_keep_the_standard_verifier_with_block_on(v8_target, monkeypatch):
    """With block on, a step whose draft branches goes to verify_sampled and a chain to verify_block."""
    import serving.spec_decode.speculator as speculator

    calls = []
    monkeypatch.setattr(speculator, "verify_block", lambda tree, *a: calls.append("block") or verify_block(tree, *a))
    monkeypatch.setattr(speculator, "verify_sampled", lambda tree, *a: calls.append(tree.is_chain) or verify_sampled(tree, *a))
    engine = make_engine(v8_target, {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "block"},
                         block_size=4, max_model_len=64)
    engine.speculator.drafter = ChainsAndTrees()
    engine.generate([[3, 5]], SamplingParams(temperature=1.0, seed=0, max_tokens=24, ignore_eos=True))
    assert "block" in calls and False in calls, calls
    assert True not in calls, "chains never reach the standard verifier when block is on"
