"""Speculative decoding end to end: every drafter reproduces plain greedy decoding token for token, the
sampled law is unchanged by exact rejection sampling, stops and max_tokens cut accepted runs, requests
that need history decode beside speculating ones, bad configs are clear errors, and drafts never reach
the prefix cache.

References: greedy outputs come from the same engine without speculation; sampled laws are computed
exactly from transformers logits through `serving.sampler.target_probs`, summing over every earlier token
(a vocabulary of 8 makes that cheap).

Stub drafters know each prompt's plain greedy continuation and propose it with a fixed pattern: always
wrong, or right for the first two drafts only. The "perfect" drafter is the target drafting for itself
(`draft_model` with the target's own folder); a "partly right" one is a noisy copy of the target.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.drafters.base import Drafter
from serving.request import SamplingParams
from serving.sampler import target_probs
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.tree import DraftTree
from serving.spec_decode.verify import verify_greedy, verify_sampled
from serving.targets import build_tiny_model

import engine_helpers
from engine_helpers import assert_pool_idle, make_engine, random_prompts

VOCAB = 256
LENGTHS = (3, 7, 12, 18, 25, 33, 41, 50)  # 8 prompts of different lengths


# ---- helpers -----------------------------------------------------------------------------------------


def plain_outputs(folder, prompts, params) -> list[list[int]]:
    """Greedy (or seeded) outputs of the engine without speculation; memoized."""
    return engine_helpers.plain_outputs(folder, prompts, params, max_model_len=256)


class OracleStub(Drafter):
    """Knows each prompt's plain greedy continuation (`truth`). Proposes a chain of the true next tokens, as long as
    the budget's nodes and depth allow, the first `num_right` of them unchanged and the rest shifted by one (always
    rejected); `num_right=None` keeps all. `extra` proposes that many tokens past the budget (the speculator must
    cut them)."""

    def __init__(self, truth: dict, num_right: int | None = None, extra: int = 0, vocab: int = VOCAB):
        self.truth, self.num_right, self.extra, self.vocab = truth, num_right, extra, vocab
        self.calls = []  # (request id, num output tokens, budget, drafts)
        self.num_resets = 0

    def upcoming(self, r) -> list[int]:
        """The request's true continuation from its next token on; checks the engine kept to plain decoding."""
        truth = self.truth[tuple(r.token_ids[:r.num_prompt_tokens])]
        n = r.num_output_tokens
        assert r.output_token_ids == truth[:n], "the engine diverged from plain decoding"
        return truth[n:]

    def propose(self, ctx, requests, budgets):
        proposals = {}
        for r in requests:
            budget = budgets[r.request_id]
            upcoming = self.upcoming(r)[:min(budget.num_nodes, budget.depth) + self.extra]
            right = len(upcoming) if self.num_right is None else self.num_right
            drafts = upcoming[:right] + [(t + 1) % self.vocab for t in upcoming[right:]]
            proposals[r.request_id] = DraftTree.chain(drafts)
            self.calls.append((r.request_id, r.num_output_tokens, budget, drafts))
        return proposals

    def reset(self, request):
        self.num_resets += 1


def noisy_copy(source: Path, folder: Path, scale: float, seed: int = 1) -> Path:
    """The source model with Gaussian noise (scale x each matrix's std) on every matrix: a draft model
    that agrees with the source often, not always."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "config.json", folder / "config.json")
    g = torch.Generator().manual_seed(seed)
    weights = load_file(source / "model.safetensors")
    noisy = {name: (w + scale * w.std() * torch.randn(w.shape, generator=g)) if w.ndim > 1 else w
             for name, w in weights.items()}
    save_file(noisy, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def noisy_llama(tiny_llama, tmp_path_factory):
    return noisy_copy(Path(tiny_llama), tmp_path_factory.mktemp("noisy_llama"), scale=0.2)


# ---- every drafter reproduces plain greedy decoding ---------------------------------------------------


PREFIX = random_prompts([40], seed=7)[0]
SCENARIOS = {
    # one request, long generation
    "single": dict(prompts=random_prompts([11], seed=1), max_tokens=60),
    # 8 concurrent requests of different lengths
    "batch": dict(prompts=random_prompts(LENGTHS, seed=2), max_tokens=40),
    # 8 requests in a pool of ~150 tokens: preemption by recompute is forced
    "preempt": dict(prompts=random_prompts(LENGTHS, seed=3), max_tokens=40, pool_tokens=150, max_model_len=96),
    # a warm-up request leaves a 40-token prefix in the cache, then 8 requests share it
    "prefix": dict(prompts=[PREFIX + s for s in random_prompts((1, 2, 4, 6, 9, 13, 17, 3), seed=4)],
                   warmup=PREFIX + random_prompts([5], seed=5)[0], max_tokens=30),
    # a token budget of 8 per step: chunked prefill beside verification, drafts squeezed by the budget
    "chunked": dict(prompts=random_prompts(LENGTHS, seed=6), max_tokens=25, engine=dict(max_num_batched_tokens=8)),
}

# (case id, drafter, k, block size, scenario). Drafter: a speculative config, or "wrong" / "first-two"
# for the oracle stubs; "SELF" and "NOISY" stand for the target's own folder and the noisy copy.
CASES = [
    ("ngram-1-3-bs16-batch", {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, 4, 16, "batch"),
    ("ngram-1-3-bs1-preempt", {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, 4, 1, "preempt"),
    ("ngram-2-4-bs3-single", {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}, 3, 3, "single"),
    ("ngram-2-4-bs16-prefix", {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}, 3, 16, "prefix"),
    ("ngram-1-1-bs3-batch", {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 1}, 2, 3, "batch"),
    ("perfect-bs16-single", {"method": "draft_model", "model": "SELF"}, 4, 16, "single"),
    ("perfect-bs16-batch", {"method": "draft_model", "model": "SELF"}, 4, 16, "batch"),
    ("perfect-bs3-preempt", {"method": "draft_model", "model": "SELF"}, 4, 3, "preempt"),
    ("perfect-bs1-prefix", {"method": "draft_model", "model": "SELF"}, 3, 1, "prefix"),
    ("noisy-bs16-batch", {"method": "draft_model", "model": "NOISY"}, 3, 16, "batch"),
    ("noisy-bs3-preempt", {"method": "draft_model", "model": "NOISY"}, 3, 3, "preempt"),
    ("noisy-bs1-single", {"method": "draft_model", "model": "NOISY"}, 5, 1, "single"),
    ("early1-bs16-batch", {"method": "early_exit", "num_layers": 1}, 3, 16, "batch"),
    ("early1-bs3-prefix", {"method": "early_exit", "num_layers": 1}, 3, 3, "prefix"),
    ("early2-bs1-batch", {"method": "early_exit", "num_layers": 2}, 2, 1, "batch"),
    ("early2-bs16-preempt", {"method": "early_exit", "num_layers": 2}, 4, 16, "preempt"),
    ("wrong-bs3-batch", "wrong", 3, 3, "batch"),
    ("wrong-bs16-preempt", "wrong", 3, 16, "preempt"),
    ("wrong-bs1-prefix", "wrong", 4, 1, "prefix"),
    ("first-two-bs16-batch", "first-two", 4, 16, "batch"),
    ("first-two-bs3-preempt", "first-two", 4, 3, "preempt"),
    ("first-two-bs1-single", "first-two", 3, 1, "single"),
    ("perfect-bs3-chunked", {"method": "draft_model", "model": "SELF"}, 4, 3, "chunked"),
    ("ngram-1-3-bs1-chunked", {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, 4, 1, "chunked"),
    ("early1-bs16-chunked", {"method": "early_exit", "num_layers": 1}, 3, 16, "chunked"),
    ("first-two-bs16-chunked", "first-two", 4, 16, "chunked"),
]


def run_case(tiny_llama, noisy_llama, drafter, k, block_size, scenario):
    """Runs one case; returns (engine, outputs of the scenario's main prompts, plain greedy outputs)."""
    sc = SCENARIOS[scenario]
    params = SamplingParams(max_tokens=sc["max_tokens"], ignore_eos=True)
    all_prompts = ([sc["warmup"]] if "warmup" in sc else []) + sc["prompts"]
    plain = plain_outputs(tiny_llama, all_prompts, params)
    if isinstance(drafter, str):
        spec = {"method": "ngram", "num_speculative_tokens": k}
    else:
        spec = dict(drafter, num_speculative_tokens=k)
        if spec.get("model") == "SELF":
            spec["model"] = str(tiny_llama)
        elif spec.get("model") == "NOISY":
            spec["model"] = str(noisy_llama)
    num_blocks = -(-sc["pool_tokens"] // block_size) if "pool_tokens" in sc else None
    engine = make_engine(tiny_llama, spec, block_size=block_size, num_blocks=num_blocks,
                         max_model_len=sc.get("max_model_len", 128), **sc.get("engine", {}))
    if isinstance(drafter, str):
        truth = {tuple(p): out for p, out in zip(all_prompts, plain)}
        engine.speculator.drafter = OracleStub(truth, num_right=0 if drafter == "wrong" else 2)
    if "warmup" in sc:
        assert engine.generate([sc["warmup"]], params)[0].token_ids == plain[0]
        plain = plain[1:]
    outputs = engine.generate(sc["prompts"], params)
    return engine, outputs, plain


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_speculation_reproduces_plain_greedy(case, tiny_llama, noisy_llama):
    _, drafter, k, block_size, scenario = case
    engine, outputs, plain = run_case(tiny_llama, noisy_llama, drafter, k, block_size, scenario)
    sc = SCENARIOS[scenario]
    for out, expected in zip(outputs, plain):
        assert out.token_ids == expected
        assert len(out.token_ids) == sc["max_tokens"] and out.finish_reason == "length"
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert sum(stats.proposed) > 0, "the drafter never drafted: the case tests nothing"
    if scenario == "preempt":
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    if scenario == "prefix":
        assert all(o.metrics["num_cached_tokens"] >= block_size for o in outputs)
        assert all(o.metrics["num_cached_tokens"] <= len(PREFIX) + 17 for o in outputs)

    if drafter == "wrong":
        assert stats.tau == 1.0 and stats.acceptance_rate == 0.0 and sum(stats.accepted) == 0
        for o in outputs:
            assert o.metrics["spec"]["tau"] == 1.0 and o.metrics["spec"]["acceptance_rate"] == 0.0
    if drafter == "first-two":
        # every verify step with d drafts accepts min(2, d) of them
        assert stats.accepted[0] == stats.proposed[0] and stats.accepted[1] == stats.proposed[1]
        assert sum(stats.accepted[2:]) == 0
    if isinstance(drafter, dict) and drafter.get("model") == "SELF" and scenario in ("single", "batch"):
        # perfect drafter: k drafts accepted per step, bar the last steps capped by max_tokens
        m = sc["max_tokens"]
        exact = (m - 1) / math.ceil((m - 1) / (k + 1))  # first token comes from the prefill, unrecorded
        assert stats.acceptance_rate == 1.0
        assert stats.tau == pytest.approx(exact) and stats.tau >= 0.9 * (k + 1)
        for o in outputs:
            assert o.metrics["spec"]["tau"] == pytest.approx(exact)
            assert o.metrics["spec"]["acceptance_rate"] == 1.0
    if isinstance(drafter, dict) and drafter.get("model") == "NOISY" and scenario != "preempt":
        assert 0 < stats.acceptance_rate < 1, "the noisy draft model should be partly right"


# ---- the sampled law ----------------------------------------------------------------------------------

SAMPLE_PROMPT = [3, 5]
NUM_SAMPLES = 3000


@pytest.fixture(scope="module")
def v8_draft(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("v8_draft"), "llama", seed=1, vocab_size=8, initializer_range=0.3)


@torch.no_grad()
def last_logits(hf, contexts: list[list[int]]) -> torch.Tensor:
    """[len(contexts), vocab] float32 logits after each context (all the same length)."""
    return hf(torch.tensor(contexts)).logits[:, -1].float()


def exact_marginals(hf, prompt, params, depth) -> list[torch.Tensor]:
    """P(x_j) for j = 1..depth: the joint law of every earlier token, summed out exactly."""
    joint = {(): 1.0}
    marginals = []
    for _ in range(depth):
        prefixes = list(joint)
        probs = target_probs(last_logits(hf, [prompt + list(x) for x in prefixes]), params).double()
        marginals.append(sum(joint[x] * probs[i] for i, x in enumerate(prefixes)))
        joint = {x + (t,): joint[x] * float(probs[i, t]) for i, x in enumerate(prefixes) for t in range(probs.shape[1])}
    return marginals


def exact_first_verify(target_hf, draft_hf, prompt, params, greedy_draft: bool) -> torch.Tensor:
    """Law of the number of drafts accepted (0, 1, 2) in the first verify step, which carries 2 drafts
    after x1: P(accept d) = sum_d min(p(d), q(d)) per position, q the drafter's law (one-hot for greedy)."""
    def q_of(logits):
        if greedy_draft:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
        return torch.softmax(logits, -1).double()

    vocab = 8
    p1 = target_probs(last_logits(target_hf, [prompt]), params)[0].double()
    ctx1 = [prompt + [x1] for x1 in range(vocab)]
    p2 = target_probs(last_logits(target_hf, ctx1), params).double()  # [x1, vocab]
    q2 = q_of(last_logits(draft_hf, ctx1))
    ctx2 = [prompt + [x1, d1] for x1 in range(vocab) for d1 in range(vocab)]
    p3 = target_probs(last_logits(target_hf, ctx2), params).double().view(vocab, vocab, vocab)
    q3 = q_of(last_logits(draft_hf, ctx2)).view(vocab, vocab, vocab)
    first = torch.minimum(p2, q2)  # [x1, d1]: draft d1 proposed and accepted
    second = torch.minimum(p3, q3).sum(-1)  # [x1, d1]: then d2 accepted
    accept_one = (p1 * first.sum(-1)).sum()
    accept_two = (p1 * (first * second).sum(-1)).sum()
    return torch.stack([1 - accept_one, accept_one - accept_two, accept_two])


def tv(empirical_counts: torch.Tensor, law: torch.Tensor) -> float:
    return 0.5 * float((empirical_counts.double() / empirical_counts.sum() - law).abs().sum())


SAMPLED_CASES = [
    ("perfect-T1", True, 1.0),
    ("perfect-top_p0.9", True, 0.9),
    ("draft_q-T1", False, 1.0),
]


@pytest.mark.parametrize("case", SAMPLED_CASES, ids=[c[0] for c in SAMPLED_CASES])
def test_sampled_law_is_the_target_law(case, v8_target, v8_draft):
    name, perfect, top_p = case
    draft = v8_target if perfect else v8_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    if not perfect:
        spec["draft_temperature"] = 1.0
    engine = make_engine(v8_target, spec, block_size=4, num_blocks=4096, max_model_len=64, max_num_seqs=128,
                         max_num_batched_tokens=8192)
    first_verify = {}  # request id -> (num drafts, num accepted) of its first verify step
    record = engine.speculator.record

    def spy(request, tree, path, num_emitted):
        assert tree.parents == tuple(range(-1, len(tree) - 1)), "a draft model drafts chains"
        assert path == list(range(len(path)))
        # a sampling drafter's q travels in its tree: one distribution per node, and each node's token is possible
        if not perfect and tree:
            assert tree.q is not None and tree.q.shape == (len(tree), 8)
            assert all(float(tree.q[i, t]) > 0 for i, t in enumerate(tree.tokens))
        first_verify.setdefault(request.request_id, (len(tree), len(path)))
        record(request, tree, path, num_emitted)

    engine.speculator.record = spy
    depth = 4  # x1 from the prefill, x2 x3 verified as two drafts, x4 the bonus or a plain step
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=i, max_tokens=depth, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    outputs = engine.generate([SAMPLE_PROMPT] * NUM_SAMPLES, params)
    assert all(len(o.token_ids) == depth for o in outputs)
    assert_pool_idle(engine)

    # drafts were proposed, and both accepted and rejected
    assert all(first_verify[o.request_id][0] == 2 for o in outputs), "every request drafts 2 tokens after x1"
    stats = engine.speculator.stats
    assert 0 < sum(stats.accepted) < sum(stats.proposed)

    target_hf = AutoModelForCausalLM.from_pretrained(v8_target, dtype=torch.float32).eval()
    draft_hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    law_params = params[0]
    laws = exact_marginals(target_hf, SAMPLE_PROMPT, law_params, depth)
    tokens = torch.tensor([o.token_ids for o in outputs])  # [samples, depth]
    distances = []
    for j in range(depth):
        counts = torch.bincount(tokens[:, j], minlength=8)
        distances.append(tv(counts, laws[j]))
    accept_law = exact_first_verify(target_hf, draft_hf, SAMPLE_PROMPT, law_params, greedy_draft=perfect)
    accept_counts = torch.bincount(torch.tensor([first_verify[o.request_id][1] for o in outputs]), minlength=3)
    accept_tv = tv(accept_counts, accept_law)
    print(f"\n{name}: TV per position {[round(d, 4) for d in distances]}, first-verify acceptance TV "
          f"{accept_tv:.4f} (law {[round(float(x), 3) for x in accept_law]})")
    # the brief allows 0.07; seeded noise here is ~0.015, and a residual that ignores q reaches ~0.08
    assert max(distances) < 0.05, f"TV per generated position {distances}"
    assert accept_tv < 0.05, f"accepted-count law {accept_counts.tolist()} vs {accept_law.tolist()}"
    # a sanity check of the reference itself: the laws are not uniform, so a wrong law would show
    assert float(laws[0].max()) > 0.2


def test_greedy_beside_sampled_requests_with_a_sampling_drafter(tiny_llama, noisy_llama):
    """A drafter with draft_temperature drafts greedily for greedy requests: they stay exactly greedy beside
    sampled ones. A seeded sampled request's output does not depend on its batch neighbours."""
    prompts = random_prompts((5, 9, 17, 23, 31, 40), seed=41)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9, seed=i)
              for i in range(len(prompts))]
    spec = {"method": "draft_model", "model": str(noisy_llama), "draft_temperature": 1.0, "num_speculative_tokens": 3}
    plain = plain_outputs(tiny_llama, prompts, params)
    outputs = make_engine(tiny_llama, spec).generate(prompts, params)
    for i, (out, ref) in enumerate(zip(outputs, plain)):
        if params[i].is_greedy:
            assert out.token_ids == ref
        else:
            alone = make_engine(tiny_llama, spec).generate([prompts[i]], [params[i]])[0]
            assert out.token_ids == alone.token_ids
            assert out.metrics["spec"]["spec_decode_num_draft_tokens"] > 0


# ---- stops and max_tokens inside an accepted run -------------------------------------------------------


def test_stop_token_inside_an_accepted_run_cuts_the_rest(tiny_llama):
    """Perfect drafter, k=4: after the prefill token each step emits 5 tokens (output indices 1-5, 6-10, ...),
    indices 1..4 mod 5 of them accepted drafts. A stop token at an index s with s % 5 in (1, 2, 3) sits inside
    an accepted run with accepted drafts behind it."""
    k, m = 4, 40
    params = SamplingParams(max_tokens=m, ignore_eos=True)
    found = None
    for seed in range(20):
        prompt = random_prompts([9], seed=100 + seed)[0]
        plain = plain_outputs(tiny_llama, [prompt], params)[0]
        for s in range(6, m):
            if s % (k + 1) in (1, 2, 3) and plain[s] not in plain[:s]:
                found = prompt, plain, s
                break
        if found:
            break
    assert found, "no prompt with a fresh token mid-run"
    prompt, plain, s = found
    stop = plain[s]
    stop_params = SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=[stop])
    reference = plain_outputs(tiny_llama, [prompt], stop_params)[0]
    assert reference == plain[:s + 1]
    engine = make_engine(tiny_llama, {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": k})
    other = random_prompts([14], seed=99)[0]  # a neighbour without the stop keeps running
    out, neighbour = engine.generate([prompt, other], [stop_params, params])
    assert out.token_ids == reference and out.finish_reason == "stop"
    assert neighbour.token_ids == plain_outputs(tiny_llama, [other], params)[0]
    spec = out.metrics["spec"]
    # the stop came in verify step ceil(s / 5), which emitted only up to the stop
    assert spec["num_verify_steps"] == math.ceil(s / (k + 1))
    assert spec["num_emitted_tokens"] == s
    assert_pool_idle(engine)


def test_max_tokens_mid_run_gives_exactly_max_tokens(tiny_llama):
    k = 4
    prompts = random_prompts((5, 8, 13, 21, 6, 9, 17, 11, 4), seed=11)
    max_tokens = (1, 2, 3, 5, 6, 7, 8, 11, 12)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    expected = plain_outputs(tiny_llama, prompts, params)
    for engine_spec in ({"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": k},
                        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": k}):
        engine = make_engine(tiny_llama, engine_spec, block_size=3)
        outputs = engine.generate(prompts, params)
        for out, m, ref in zip(outputs, max_tokens, expected):
            assert len(out.token_ids) == m and out.finish_reason == "length"
            assert out.token_ids == ref
        assert_pool_idle(engine)


@pytest.mark.parametrize("max_model_len", [45, 47, 50, 53])
def test_max_model_len_mid_run_matches_plain(tiny_llama, max_model_len):
    """Drafts are capped by the context: a request ends with exactly max_model_len tokens, as in plain decoding."""
    prompts = random_prompts((5, 9, 17, 23, 31, 40, 2, 12), seed=0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = make_engine(tiny_llama, max_model_len=max_model_len).generate(prompts, params)
    engine = make_engine(tiny_llama, {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4},
                         block_size=3, max_model_len=max_model_len)
    outputs = engine.generate(prompts, params)
    for out, ref, prompt in zip(outputs, plain, prompts):
        assert out.token_ids == ref.token_ids and out.finish_reason == "length"
        assert len(prompt) + len(out.token_ids) == min(max_model_len, len(prompt) + 40)
    assert sum(engine.speculator.stats.accepted) > 0
    assert_pool_idle(engine)


# ---- requests that need history ------------------------------------------------------------------------


def test_requests_needing_history_decode_plainly_beside_speculating_ones(tiny_llama):
    """Penalties decode plainly; logprobs speculate, read from the verified rows: the same as plain decoding's."""
    prompts = random_prompts((6, 15, 9, 22, 12, 30), seed=21)
    params = [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, ignore_eos=True, logprobs=True, top_logprobs=5),
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=5, repetition_penalty=1.2),
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=0.5, logprobs=True),
    ]
    needs_history = [p.needs_history for p in params]
    assert needs_history == [False, True, False, True, False, True]
    plain_engine = make_engine(tiny_llama)
    plain = plain_engine.generate(prompts, params)
    engine = make_engine(tiny_llama, {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3},
                         block_size=3)
    outputs = engine.generate(prompts, params)
    for out, ref, history in zip(outputs, plain, needs_history):
        assert out.token_ids == ref.token_ids
        assert len(out.token_ids) == 30
        if history:
            spec = out.metrics.get("spec")
            assert spec is None or spec["spec_decode_num_draft_tokens"] == 0
        else:
            assert out.metrics["spec"]["spec_decode_num_draft_tokens"] > 0
            assert out.metrics["spec"]["tau"] > 3.0
        if ref.logprobs is not None:
            assert out.logprobs is not None and len(out.logprobs) == 30
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=1e-4)
        if ref.top_logprobs is not None:
            ids = [[t for t, _ in row] for row in out.top_logprobs]
            assert ids == [[t for t, _ in row] for row in ref.top_logprobs]
            torch.testing.assert_close(torch.tensor([[lp for _, lp in row] for row in out.top_logprobs]),
                                       torch.tensor([[lp for _, lp in row] for row in ref.top_logprobs]),
                                       atol=1e-4, rtol=1e-4)
            assert len(out.top_logprobs) == 30 and all(len(row) == 5 for row in out.top_logprobs)
    # penalties really changed those outputs (else the comparison would not show they ran penalised)
    greedy = plain_outputs(tiny_llama, [prompts[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert outputs[1].token_ids != greedy
    assert_pool_idle(engine)


# ---- SpeculativeConfig ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ('{"method": "ngram", "num_speculative_tokenz": 3}', r"unknown speculative config keys \['num_speculative_tokenz'\]"),
    ('{"method": "ngram",', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"num_speculative_tokens": 3}', 'needs "method"'),
    ('{"method": "jacobi"}', "speculative method 'jacobi' is unknown"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens=-2"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens=2.5"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must satisfy 1 <= min <= max"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "must satisfy 1 <= min <= max"),
    ('{"method": "draft_model"}', 'speculative method \'draft_model\' needs "model"'),
    ('{"method": "ngram", "prompt_lookup_first": true}', r"prompt_lookup_first applies to medusa.*not 'ngram' \(which drafts"),
    ('{"method": "eagle", "model": "x", "prompt_lookup_first": "yes"}', "prompt_lookup_first='yes' must be true or false"),
    ('{"method": "eagle", "model": "x", "prompt_lookup_first": true, "prompt_lookup_min": 4}', "must satisfy 1 <= min <= max"),
    ('{"method": "early_exit"}', 'early_exit needs "num_layers" >= 1'),
    ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size=0 must be an integer >= 1"),
    ('{"method": "ngram", "disable_by_batch_size": 2.5}', "disable_by_batch_size=2.5 must be an integer >= 1"),
    ('{"method": "early_exit", "num_layers": 0}', 'early_exit needs "num_layers" >= 1'),
    ('{"method": "draft_model", "model": "x", "draft_temperature": -1}', "draft_temperature=-1 must be >= 0"),
    ('{"method": "eagle3", "model": "x", "draft_temperature": 1.5}', "draft_temperature applies to draft_model, not 'eagle3'"),
    ('{"method": "eagle", "model": "x", "confidence_threshold": 1}', r"confidence_threshold=1 must be in \[0, 1\)"),
    ('{"method": "eagle", "model": "x", "confidence_threshold": -0.1}', "confidence_threshold=-0.1"),
    ('{"method": "eagle", "model": "x", "confidence_threshold": "high"}', "confidence_threshold='high'"),
    ('{"method": "ngram", "confidence_threshold": 0.5}', "confidence_threshold applies to medusa, eagle, eagle3, mtp"),
    ('{"method": "eagle", "model": "x", "draft_weights": "float16"}', "draft_weights='float16' must be one of bfloat16, float32, int8"),
    ('{"method": "draft_model", "model": "x", "draft_weights": "float32"}', "draft_weights applies to medusa, eagle"),
    ('{"method": "eagle", "model": "x", "topk": 0}', r"topk=0 must be an integer >= 1 \(1: a chain"),
    ('{"method": "eagle", "model": "x", "topk": 2.0}', "topk=2.0 must be an integer"),
    ('{"method": "eagle", "model": "x", "topk": true}', "topk=True must be an integer"),
    ('{"method": "ngram", "topk": 2}',
     r"draft trees \(topk, medusa_choices\) apply to medusa, eagle, eagle3, mtp, peagle, dflash, dspark heads, not 'ngram'"),
    ('{"method": "draft_model", "model": "x", "medusa_choices": [[0]]}',
     r"draft trees \(topk, medusa_choices\) apply to medusa, eagle, eagle3, mtp, peagle, dflash, dspark heads, not 'draft_model'"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 4}',
     "num_draft_tokens=4 cannot hold a path of num_speculative_tokens=4"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "num_draft_tokens": 3}',
     "num_draft_tokens=3 cannot hold a path of num_speculative_tokens=3"),
    ('{"method": "eagle", "model": "x", "num_draft_tokens": 1}', "num_draft_tokens=1 must be an integer >= 2"),
    ('{"method": "eagle", "model": "x", "num_draft_tokens": 4.0}', "num_draft_tokens=4.0 must be an integer"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 2, "topk": 2, "num_draft_tokens": 8}',
     "num_draft_tokens=8 asks for 7 draft nodes but the tree has 6 candidates at most"),
    ('{"method": "eagle", "model": "x", "medusa_choices": [[0]]}', "medusa_choices applies to medusa heads, not 'eagle'"),
    ('{"method": "medusa", "model": "x", "medusa_choices": [[0]], "topk": 2}', "give either medusa_choices"),
    ('{"method": "medusa", "model": "x", "medusa_choices": []}', "must be a non-empty list of paths of ranks"),
    ('{"method": "medusa", "model": "x", "medusa_choices": [[0], [-1]]}', r"\[-1\] is not a path of ranks"),
    ('{"method": "medusa", "model": "x", "medusa_choices": [[0], [0]]}', r"lists a path twice: \(0,\)"),
    ('{"method": "medusa", "model": "x", "medusa_choices": [[0], [1, 0]]}', r"has \[1, 0\] but not its parent \[1\]"),
    ('{"method": "medusa", "model": "x", "num_speculative_tokens": 2, "medusa_choices": [[0], [0, 0], [0, 0, 0]]}',
     r"has \[0, 0, 0\] of depth 3 but num_speculative_tokens is 2"),
    ('{"method": "medusa", "model": "x", "medusa_choices": [[0], [1]], "num_draft_tokens": 4}',
     r"asks for 3 draft nodes but the tree has 2 candidates at most \(its medusa_choices\)"),
])
def test_bad_speculative_configs_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)
    if text.startswith("{") and text.endswith("}"):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(json.loads(text))


def test_speculative_config_forms_agree(tiny_llama):
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    expected = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5)
    assert SpeculativeConfig.from_json(text) == expected
    for form in (text, json.loads(text), expected):
        assert make_engine(tiny_llama, form).speculator.config == expected
    assert make_engine(tiny_llama).speculator is None


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(tiny_llama):
    """8 requests of different lengths at once: drafting starts only once at most 3 are left running, and greedy
    outputs are plain decoding's throughout."""
    prompts = random_prompts([5, 9, 14, 20, 7, 11, 3, 16], seed=23)
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    engine = make_engine(tiny_llama, spec, max_num_seqs=8)
    assert engine.speculator.config.label() == "ngram batch<=3"
    batch_sizes = []
    propose = engine.speculator.drafter.propose

    def spy(ctx, requests, budgets):
        batch_sizes.append(len(engine.scheduler.running))
        return propose(ctx, requests, budgets)

    engine.speculator.drafter.propose = spy
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, prompts, params)
    assert batch_sizes and max(batch_sizes) <= 3, batch_sizes
    assert sum(engine.speculator.stats.proposed) > 0


def test_tree_sizes_default_as_sglangs_and_name_the_bench_row():
    """num_draft_tokens counts the verified newest token: a chain of k drafts is k + 1, a topk tree k * topk + 1,
    Medusa's choices one more than its paths; the label names the tree."""
    chain = SpeculativeConfig(method="eagle", model="x", num_speculative_tokens=3)
    assert (chain.topk, chain.num_draft_tokens, chain.max_draft_nodes, chain.label()) == (1, 4, 3, "eagle")
    tree = SpeculativeConfig(method="eagle3", model="x", num_speculative_tokens=3, topk=2)
    assert (tree.num_draft_tokens, tree.max_draft_nodes, tree.label()) == (7, 6, "eagle3 top2 n7")
    small = SpeculativeConfig(method="mtp", model="x", num_speculative_tokens=3, topk=4, num_draft_tokens=4)
    assert (small.max_draft_nodes, small.label()) == (3, "mtp top4 n4")  # the smallest that holds a 3-deep path
    medusa = SpeculativeConfig(method="medusa", model="x", num_speculative_tokens=2,
                               medusa_choices=[[1], [0, 0], [0], [0, 1]])
    assert medusa.medusa_choices == [(1,), (0,), (0, 0), (0, 1)]  # topological: by depth, then as listed
    assert (medusa.num_draft_tokens, medusa.label()) == (5, "medusa choices4")
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=5).num_draft_tokens == 6


def test_prompt_lookup_first_looks_up_two_tokens_or_more_unless_told():
    lookup_first = SpeculativeConfig(method="eagle", model="x", prompt_lookup_first=True, confidence_threshold=0.1)
    assert (lookup_first.prompt_lookup_min, lookup_first.prompt_lookup_max) == (2, 3)
    assert lookup_first.label() == "eagle+lookup2 p>=0.1"
    assert SpeculativeConfig(method="mtp", model="x", prompt_lookup_first=True, prompt_lookup_min=1).label() == "mtp+lookup1"


def test_ngram_lookup_lengths_default_as_vllms():
    """vLLM's SpeculativeConfig: a missing bound takes the other's value, 5 and 5 when neither is given."""
    def bounds(**given):
        config = SpeculativeConfig(method="ngram", **given)
        return config.prompt_lookup_min, config.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=3) == (3, 3)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)


@pytest.mark.parametrize("num_layers", [4, 5])
def test_early_exit_needs_fewer_layers_than_the_target(tiny_llama, num_layers):
    with pytest.raises(ValueError, match=f"early_exit num_layers={num_layers} must be below the target's 4 layers"):
        make_engine(tiny_llama, {"method": "early_exit", "num_layers": num_layers})
    make_engine(tiny_llama, {"method": "early_exit", "num_layers": 3})  # the largest that is allowed


def test_draft_model_with_another_vocabulary_is_rejected(tiny_llama, v8_target):
    with pytest.raises(ValueError, match="another vocabulary"):
        make_engine(tiny_llama, {"method": "draft_model", "model": str(v8_target)})


def test_set_speculative_config_switches_drafters_while_idle(tiny_llama):
    prompts = random_prompts((7, 13), seed=51)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = plain_outputs(tiny_llama, prompts, params)
    engine = make_engine(tiny_llama)
    model = engine.model
    for config in ({"method": "ngram", "num_speculative_tokens": 3},
                   '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 2}' % tiny_llama, None):
        engine.set_speculative_config(config)
        assert engine.model is model
        assert [o.token_ids for o in engine.generate(prompts, params)] == plain
        if config is not None:
            assert sum(engine.speculator.stats.proposed) > 0
    assert engine.speculator is None
    engine.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="only while the engine is idle"):
        engine.set_speculative_config({"method": "ngram"})


DEVICE_CASES = {
    "plain": None,
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3},
    "draft_model-sampled": {"method": "draft_model", "model": "NOISY", "num_speculative_tokens": 3, "draft_temperature": 0.9},
    "early_exit": {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("spec", DEVICE_CASES.values(), ids=DEVICE_CASES.keys())
def test_the_engine_names_its_device(spec, tiny_llama, noisy_llama, device_unnamed_is_meta):
    """Every tensor the engine and its drafters make is on the engine's device: with unnamed devices on meta, greedy,
    sampled, penalised and logprob requests under preemption and chunked prefill give the tokens, logprobs and
    acceptance of the same run with the CPU by default."""
    if spec and spec.get("model") == "NOISY":
        spec = dict(spec, model=str(noisy_llama))
    sc = SCENARIOS["preempt"]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **extra) for extra in
              ({}, {"temperature": 0.8, "seed": 1}, {"temperature": 1.0, "top_p": 0.9, "seed": 2},
               {"repetition_penalty": 1.3}, {"logprobs": True}, {"temperature": 0.7, "top_k": 20, "seed": 3}, {}, {})]

    def run():
        engine = make_engine(tiny_llama, spec, num_blocks=-(-sc["pool_tokens"] // 16), max_model_len=sc["max_model_len"],
                             max_num_batched_tokens=24, device="cpu")
        outputs = engine.generate(sc["prompts"], params)
        stats = engine.speculator.stats.to_dict() if engine.speculator else None
        return [(o.token_ids, o.logprobs) for o in outputs], stats, sum(o.metrics["num_preemptions"] for o in outputs)

    expected = run()
    assert expected[2] > 0, "no preemption: the pool is too roomy"
    assert spec is None or expected[1]["spec_decode_num_draft_tokens"] > 20
    with device_unnamed_is_meta():
        assert run() == expected


def test_speculation_and_capture_are_exclusive(tiny_llama):
    with pytest.raises(ValueError, match="capture_hidden and speculative decoding cannot be combined"):
        make_engine(tiny_llama, {"method": "ngram"}, capture_hidden=True)


# ---- drafts never enter the prefix cache ------------------------------------------------------------------


def reference_kv(model, tokens, block_size):
    """K and V [num_layers, len(tokens), kv_heads, head_dim] of the real sequence, from one dense-order pass."""
    c = model.config
    num_blocks = -(-len(tokens) // block_size)
    cache = KVCache(c.num_layers, num_blocks, block_size, c.layer.num_kv_heads, c.layer.head_dim, torch.float32, "cpu")
    meta = PagedMetadata.build([len(tokens)], [len(tokens)], [list(range(num_blocks))], block_size, "cpu")
    model(torch.tensor(tokens), torch.arange(len(tokens)), PagedAttention(cache, meta), torch.tensor([len(tokens) - 1]))
    return cache.k[:, :len(tokens)], cache.v[:, :len(tokens)]


@pytest.mark.parametrize("drafter, block_size", [("wrong", 1), ("wrong", 3), ("first-two", 3), ("perfect", 4)])
def test_drafts_never_enter_the_prefix_cache(tiny_llama, drafter, block_size):
    """After every step, every registered block holds the K/V of real tokens of the hash it is registered
    under: its hash is a prefix block of some request's real (plain) sequence and its slots equal that
    sequence's K/V. Then the same prompts run again, hit the cache and give the same outputs."""
    k = 4
    prompts = [PREFIX[:20] + p for p in random_prompts((3, 8, 14, 5, 11), seed=31)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = plain_outputs(tiny_llama, prompts, params)
    if drafter == "perfect":
        spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": k}
    engine = make_engine(tiny_llama, spec, block_size=block_size)
    if drafter != "perfect":
        truth = {tuple(p): out for p, out in zip(prompts, plain)}
        engine.speculator.drafter = OracleStub(truth, num_right=0 if drafter == "wrong" else 2)

    # every full block of every real sequence: chained hash -> (sequence index, block index)
    legit = {}
    sequences = [p + out for p, out in zip(prompts, plain)]
    for s, seq in enumerate(sequences):
        parent = None
        for b in range(len(seq) // block_size):
            parent = hash((parent, tuple(seq[b * block_size:(b + 1) * block_size])))
            legit.setdefault(parent, (s, b))
    refs = [reference_kv(engine.model, seq, block_size) for seq in sequences]

    def check_registered_blocks():
        bm = engine.block_manager
        assert {bm.cached_blocks[h]: h for h in bm.cached_blocks} == bm.cached_hashes
        for block_hash, block_id in bm.cached_blocks.items():
            assert block_hash in legit, "a registered block hash is no prefix block of any real sequence"
            s, b = legit[block_hash]
            slots = slice(block_id * block_size, (block_id + 1) * block_size)
            positions = slice(b * block_size, (b + 1) * block_size)
            torch.testing.assert_close(engine.cache.k[:, slots], refs[s][0][:, positions], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(engine.cache.v[:, slots], refs[s][1][:, positions], atol=1e-4, rtol=1e-4)
        for r in engine.scheduler.running:
            # a request's hashed blocks cover only computed, real tokens
            assert len(r.block_hashes) * block_size <= min(r.num_computed_tokens, r.num_tokens)

    def run():
        ids = [engine.add_request(p, params) for p in prompts]
        results = {}
        num_steps_with_drafts = 0
        while engine.has_unfinished():
            num_steps_with_drafts += any(r.spec_token_ids for r in engine.scheduler.running)
            for out in engine.step():
                results[out.request_id] = out
            check_registered_blocks()
        assert num_steps_with_drafts > 0
        return [results[i] for i in ids]

    first = run()
    assert [o.token_ids for o in first] == plain
    assert engine.block_manager.num_cached_blocks > 0
    stats = engine.speculator.stats
    if drafter != "perfect":
        assert sum(stats.accepted) < sum(stats.proposed), "some drafts were rejected"
    second = run()
    assert [o.token_ids for o in second] == plain
    # the second run's prompts are whole prefixes of finished sequences: they hit the cache up to the last block
    for o, p in zip(second, prompts):
        assert o.metrics["num_cached_tokens"] == (len(p) - 1) // block_size * block_size > 0
    assert_pool_idle(engine)


# ---- trees: the accepted path off the slot order --------------------------------------------------------


class TreeOracle(OracleStub):
    """Drafts a tree whose first child of the newest token is a wrong token and whose second child is the true next
    token, with the true tokens after it in a chain below it: nodes [wrong, t1, t2, ...], parents [-1, -1, 1, 2, ...].
    The accepted path is nodes 1, 2, ...: node i at depth i, one slot past its position, so every accepted node's
    K/V moves."""

    def __init__(self, truth: dict):
        super().__init__(truth)
        self.trees = []

    def propose(self, ctx, requests, budgets):
        trees = {}
        for r in requests:
            true = self.upcoming(r)[:budgets[r.request_id].depth]
            tokens = [(true[0] + 2) % self.vocab] + true
            trees[r.request_id] = DraftTree(tokens, [-1, -1] + list(range(1, len(true))))
            self.trees.append(trees[r.request_id])
        return trees  # deeper than the budget's nodes where the room is short: the speculator cuts it


@pytest.mark.parametrize("scenario,block_size", [("batch", 3), ("preempt", 16), ("prefix", 1), ("chunked", 16), ("single", 4)])
def test_an_accepted_branch_off_the_slot_order_reproduces_plain_greedy(tiny_llama, scenario, block_size):
    """Every step's true continuation comes as the root's second child and the chain below it: accepted, each node's
    K/V moved into place, the output stays plain decoding's, and each verify step that carried a whole tree emits
    its depth plus one. Where the pool or the token budget is short, the tree is cut to its first nodes (the wrong
    one first) and some steps accept less or nothing."""
    k = 3
    sc = SCENARIOS[scenario]
    params = SamplingParams(max_tokens=sc["max_tokens"], ignore_eos=True)
    all_prompts = ([sc["warmup"]] if "warmup" in sc else []) + sc["prompts"]
    plain = plain_outputs(tiny_llama, all_prompts, params)
    num_blocks = -(-sc["pool_tokens"] // block_size) if "pool_tokens" in sc else None
    engine = make_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": k}, block_size=block_size,
                         num_blocks=num_blocks, max_model_len=sc.get("max_model_len", 128), **sc.get("engine", {}))
    engine.speculator.drafter = drafter = TreeOracle({tuple(p): out for p, out in zip(all_prompts, plain)})
    # a stub stands in for a head, the only drafter whose config takes trees: room for the wrong node and k true ones
    engine.speculator.config.num_draft_tokens = k + 2
    moves = []
    move = engine.cache.move

    def spy(block_table, source, target):
        moves.append(source - target)
        move(block_table, source, target)

    engine.cache.move = spy
    outputs = engine.generate(all_prompts, params)
    assert [o.token_ids for o in outputs] == plain
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert drafter.trees and any(len(tree) == k + 1 for tree in drafter.trees)
    assert sum(stats.accepted) > 0 and stats.accepted[0] > 0 and stats.accepted[1] > 0
    assert moves and set(moves) == {1}, "each accepted node sits one slot past its position"
    assert len(moves) == sum(stats.accepted)  # every accepted node moved, none else
    if scenario not in ("preempt", "chunked"):
        # whole trees: every depth proposed is accepted, one wrong node beside the path
        assert stats.accepted == stats.proposed
        assert stats.num_draft_tokens == sum(stats.proposed) + stats.num_drafts
        assert stats.num_emitted == stats.num_steps + sum(stats.proposed)
        assert stats.acceptance_rate < 1.0


def test_greedy_verification_follows_the_targets_choice_down_the_tree():
    """Node i's row is 1 + i; the path follows, at each node, the child whose token is the target's argmax there."""
    #        root
    #       /     \
    #   0:6        1:5
    #   /  \         \
    # 2:9  3:4       5:2
    #        \
    #        4:7
    tree = DraftTree((6, 5, 9, 4, 7, 2), (-1, -1, 0, 0, 3, 1))
    assert tree.depths == (1, 1, 2, 2, 3, 2)

    def best(rows: dict) -> list[int]:  # the target's argmax at each row: 0 unless told
        return [rows.get(row, 0) for row in range(1 + len(tree))]

    # the second child at depth 2, then its child: rows 0 (root), 1 (node 0), 4 (node 3), 5 (node 4, a leaf)
    assert verify_greedy(tree, best({0: 6, 1: 4, 4: 7, 5: 1})) == ([0, 3, 4], [6, 4, 7, 1])
    assert verify_greedy(tree, best({0: 6, 1: 9, 3: 8})) == ([0, 2], [6, 9, 8])  # the first child, a leaf
    assert verify_greedy(tree, best({0: 6, 1: 4, 4: 3})) == ([0, 3], [6, 4, 3])  # node 4 rejected
    assert verify_greedy(tree, best({0: 6, 1: 2})) == ([0], [6, 2])  # both depth-2 children rejected
    assert verify_greedy(tree, best({0: 5, 2: 2, 6: 3})) == ([1, 5], [5, 2, 3])  # the root's second child
    assert verify_greedy(tree, best({0: 5, 2: 4})) == ([1], [5, 4])  # 4 is node 3's token, not a child of node 1
    assert verify_greedy(tree, best({0: 9})) == ([], [9])  # 9 is deeper in the tree, not a child of the root
    assert verify_greedy(tree, best({0: 3})) == ([], [3])
    # rows of nodes off the path do not matter
    assert verify_greedy(tree, best({0: 5, 1: 9, 2: 2, 3: 1, 6: 3})) == ([1, 5], [5, 2, 3])
    # a chain, and no tree at all
    assert verify_greedy(DraftTree.chain([6, 9]), [6, 9, 7]) == ([0, 1], [6, 9, 7])
    assert verify_greedy(DraftTree.chain([6, 9]), [6, 1, 7]) == ([0], [6, 1])
    assert verify_greedy(DraftTree(), [8]) == ([], [8])


def test_sampled_tree_verification_keeps_the_target_law():
    """Deterministic children, two at the root and two below the first: the first token follows the first row's
    distribution whichever child (or none) it came from, and the token after an accepted node follows that node's
    own row, at depth 1 and 2."""
    #        root
    #       /     \
    #   0:1        1:3
    #   /  \
    # 2:4  3:2
    vocab = 6
    tree = DraftTree((1, 3, 4, 2), (-1, -1, 0, 0))
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(1 + len(tree), vocab, generator=g) ** 2
    probs[0] = torch.tensor([0.25, 0.3, 0.1, 0.2, 0.1, 0.05])  # both children of the root likely
    probs[1] = torch.tensor([0.1, 0.05, 0.25, 0.1, 0.35, 0.15])  # and both children of node 0
    probs /= probs.sum(-1, keepdim=True)
    first = torch.zeros(vocab)
    after = {node: torch.zeros(vocab) for node in range(len(tree))}  # the token emitted after accepting `node`
    for _ in range(30000):
        path, emitted = verify_sampled(tree, probs.clone(), g)  # as the engine: fresh probabilities every step
        assert emitted[:len(path)] == [tree.tokens[n] for n in path] and len(emitted) == len(path) + 1
        assert path == (tree.path(path[-1]) if path else [])
        # a rejected child's token is out of the residual: a child's token comes first exactly where it was accepted
        assert bool(path) == (emitted[0] in (1, 3))
        first[emitted[0]] += 1
        if path:
            after[path[-1]][emitted[len(path)]] += 1
    assert tv(first, probs[0]) < 0.02
    # a path that ends at node 0 rejected both its children: the token is drawn from its row without theirs
    residual = probs[1] * torch.tensor([1.0, 1, 0, 1, 0, 1])
    assert tv(after[0], residual / residual.sum()) < 0.03
    for node in range(len(tree)):
        assert after[node].sum() > 1000
    # the token at depth 2 (an accepted child of node 0, or drawn from node 0's residual) follows node 0's row
    second_after_0 = after[0] + torch.zeros(vocab).index_add_(0, torch.tensor([4, 2]), torch.stack(
        [after[2].sum(), after[3].sum()]))
    assert tv(second_after_0, probs[1]) < 0.03
    assert tv(after[1], probs[2]) < 0.03  # the root's second child is a leaf: its own row
    assert tv(after[2], probs[3]) < 0.03
    assert tv(after[3], probs[4]) < 0.03


def test_sampled_verification_leaves_the_targets_probabilities_alone():
    """Rejecting a deterministic child takes its token out of a residual, not out of the caller's distributions."""
    tree = DraftTree((1, 3, 4, 2), (-1, -1, 0, 0))
    probs = torch.softmax(torch.randn(1 + len(tree), 6, generator=torch.Generator().manual_seed(3)), -1)
    before = probs.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        verify_sampled(tree, probs, g)
    assert torch.equal(probs, before)
