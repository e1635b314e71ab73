"""The head drafters in the engine (serving/drafters/head.py, medusa.py, eagle.py, mtp.py, tree_search.py): Medusa,
EAGLE-1, EAGLE-3 and MTP.

1. Whatever a head proposes, greedy outputs are plain greedy decoding's, token for token: random heads
   (parameters perturbed, so their drafts are not the target's), concurrency 1 and 8, forced preemption,
   chunked prefill, Llama and Qwen3 targets.
2. Paged equals dense: every proposal of the EAGLE-1, EAGLE-3 and MTP drafters, whose K/V live in a pool
   addressed by the target's block tables and are rebuilt by catch-up every step, equals the same module run
   densely (heads.attention.DenseCausalAttention) over the pairs (h_p, x_{p+1}) for p in [0, T-2], with h
   from transformers (final hidden state after the norm; EAGLE-3: hidden_states[i] of its aux layers), then
   continued autoregressively on its own output features (draft s+1 from the entry (draft s, previous
   output) at position T-2+s). The same after prefix-cache hits. Medusa: head i on h_{T-2}.
3. Oracle: heads overfit (plain torch, AdamW) on the target's own greedy continuations must draft them back:
   every draft accepted, tau close to k + 1. EAGLE-1, EAGLE-3 and MTP train unrolled with the engine's
   drafting semantics: step s at anchor t feeds (x_{t+1+s}, its previous output) at position t+s, attending
   to the real positions <= t and to its own earlier steps. Checked by mutating the drafters (then one heads.py):
   reading Medusa's row one position early gives tau 1.04; a catch-up pairing h_p with x_p instead of
   x_{p+1} gives MTP tau 1.30, EAGLE-3 2.23 and EAGLE acceptance 0.83 (on greedy data x_{p+1} = argmax
   lm_head(h_p), so EAGLE's token input is nearly redundant); rope offsets of the catch-up or draft positions
   leave overfit heads unmoved (rope is relative) and are caught by 2 only.
4. save -> load -> save drafts identically in the engine.
5. A head for another target, a method/kind mismatch, too many Medusa drafts, and an MTP head in chain mode
   are clear errors.
6. Draft trees (topk > 1): every head drafts EAGLE-2's dynamic tree, and greedy outputs stay plain decoding's.

Everything is float32 and single-threaded on tiny targets (2 shared cores).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import heads
from heads.token_map import lm_head_rows
from heads.attention import DenseCausalAttention, sdpa_gqa
from serving.attention import PagedAttention
from serving import targets
from serving.drafters.base import DraftBudget
from serving.engine import Engine
from serving.kernels import quantize_int8
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.speculator import Speculator
from serving.spec_decode.tree import DraftTree
from serving.targets import build_tiny_model

import engine_helpers
from engine_helpers import assert_pool_idle, greedy

K = 3  # drafts per step everywhere
VOCAB = 256  # the conftest targets' vocabulary
LENGTHS = (3, 7, 12, 18, 25, 33, 41, 50)  # 8 prompts of different lengths
MAX_TOKENS = 24
EAGLE3_AUX = (0, 2, 3)  # hidden_states[0] is the embedding output: the input of layer 0
KINDS = ("medusa", "eagle", "eagle3", "mtp")


# ---- helpers -----------------------------------------------------------------------------------------


def random_prompts(lengths, seed, vocab=VOCAB):
    return engine_helpers.random_prompts(lengths, seed, vocab, low=3)


# a small block size, so that prompts and drafts cross block boundaries
make_engine = partial(engine_helpers.make_engine, block_size=4, num_blocks=256, max_model_len=128)


def spec_config(kind, head_dir, k=K):
    return {"method": kind, "model": str(head_dir), "num_speculative_tokens": k}


def plain_outputs(folder, prompts, max_tokens) -> list[list[int]]:
    """Greedy outputs of the engine without speculation, roomy pool, default token budget; memoized."""
    return engine_helpers.plain_outputs(folder, prompts, greedy(max_tokens), block_size=4, num_blocks=256)


def target_parts(folder):
    return heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))


def new_head(kind, parts, seed, *, draft_vocab=None, own_lm_head=False, **fields):
    """A new head of `kind` for `parts`, seeded: Medusa with K heads, EAGLE-3 over `draft_vocab` (default: a
    random half of the vocabulary) with aux layers EAGLE3_AUX, MTP with 2 modules served by module 0; `fields` are
    further config fields of the feature heads (draft_window)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind == "medusa":
            return heads.Medusa.from_target(parts, num_heads=K, own_lm_head=own_lm_head)
        if kind == "eagle":
            return heads.Eagle.from_target(parts, **fields)
        if kind == "eagle3":
            if draft_vocab is None:
                draft_vocab = torch.randperm(parts.vocab_size)[:parts.vocab_size // 2].tolist()
            return heads.Eagle3.from_target(parts, draft_token_ids=draft_vocab, aux_layers=EAGLE3_AUX, **fields)
        if kind == "mtp":
            return heads.Mtp.from_target(parts, depth=2, serve_mode="reuse_first", **fields)
    raise AssertionError(kind)


def chain_mtp(folder, depth, draft_window=0):
    """A new MTP head for the target in `folder` served as a chain (module j drafts token j + 1), seeded: a test's
    head must not depend on what the tests before it drew."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return heads.Mtp.from_target(target_parts(folder), depth=depth, serve_mode="chain", draft_window=draft_window)


@torch.no_grad()
def perturb(head, seed):
    """Random weights everywhere, on the scale of a fresh init: Medusa's zero-initialised blocks, EAGLE-3's
    copied norm and LM head rows, MTP's unit norms all move, so drafts are not the target's."""
    g = torch.Generator().manual_seed(seed)
    for param in head.parameters():
        if param.ndim >= 2:
            param.add_(torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5)
        else:
            param.add_(0.1 * torch.randn(param.shape, generator=g))
    return head


def is_chain(tree: DraftTree) -> bool:
    return tree.parents == tuple(range(-1, len(tree) - 1))


@dataclass
class Proposal:
    request_id: str
    token_ids: list[int]  # the request's tokens when the drafter proposed
    budget: int  # the longest chain the budget allows: min(its nodes, its depth)
    drafts: list[int]  # the tree's tokens (a chain's, in order, with topk 1)
    tree: DraftTree
    budgets: DraftBudget


def record_proposals(engine) -> list[Proposal]:
    """Wraps the engine's drafter so that every proposal is recorded with the request's tokens at that time."""
    records = []
    drafter = engine.speculator.drafter
    propose = drafter.propose

    def spy(ctx, requests, budgets):
        before = {r.request_id: list(r.token_ids) for r in requests}
        proposals = propose(ctx, requests, budgets)
        for r in requests:
            if r.request_id in proposals:
                tree, budget = proposals[r.request_id], budgets[r.request_id]
                assert isinstance(tree, DraftTree) and isinstance(budget, DraftBudget)
                records.append(Proposal(r.request_id, before[r.request_id], budget.chain_length, list(tree.tokens), tree, budget))
        return proposals

    drafter.propose = spy
    return records


# ---- the dense reference --------------------------------------------------------------------------------


_HF: dict = {}


def hf_model(folder):
    if str(folder) not in _HF:
        _HF[str(folder)] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF[str(folder)]


@torch.no_grad()
def hf_hidden_states(folder, tokens) -> tuple[torch.Tensor, ...]:
    """transformers' hidden_states over `tokens`: [0] the embeddings, [i] the input of layer i, [-1] the last
    layer's output after the final norm; each [len(tokens), hidden]."""
    out = hf_model(folder)(torch.tensor([tokens]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def head_forward(head, ids, features, positions, attention):
    if head.config.kind == "mtp":
        return head.forward_module(0, ids, features, positions, attention)
    return head(ids, features, positions, attention)


def head_logits(head, out):
    """Logits over the head's own vocabulary (EAGLE-3: the draft vocabulary)."""
    return head.logits(0, out) if head.config.kind == "mtp" else head.logits(out)


def to_target_ids(head, ids):
    return head.to_target_ids(ids) if head.config.kind == "eagle3" else ids


def head_features(head, states, num):
    """The features of positions [0, num): fuse(aux) for EAGLE-3, h after the final norm otherwise."""
    if head.config.kind == "eagle3":
        return head.fuse([states[i][:num] for i in head.config.aux_layers])
    return states[-1][:num]


@torch.no_grad()
def dense_drafts(head, states, tokens, num_drafts):
    """The drafts after `tokens` (T of them; `states` cover at least T-1 positions): the head over the pairs
    (h_p, x_{p+1}) at positions p in [0, T-2] with dense causal attention gives draft 1 from its last output;
    draft s+1 comes from the entry (draft s, the previous output) at position T-2+s; a head's draft_window limits
    every row to the keys of its sliding window (an explicit mask). Returns the drafts and the
    top-2 logit margin and the logits of each (near-ties could flip between paged and dense)."""
    T = len(tokens)
    features = head_features(head, states, T - 1)  # [T-1, hidden]
    ids = list(tokens[1:])
    drafts, margins, all_logits = [], [], []
    for _ in range(num_drafts):
        num = len(ids)
        out = head_forward(head, torch.tensor(ids)[None], features[None], torch.arange(num)[None],
                           DenseCausalAttention(window=head.config.draft_window))[0]  # [num, hidden]
        logits = head_logits(head, out[-1])
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        all_logits.append(logits)
        token = int(to_target_ids(head, logits.argmax(-1)))
        drafts.append(token)
        ids.append(token)
        features = torch.cat([features, out[-1:]])
    return drafts, margins, all_logits


@torch.no_grad()
def dense_medusa_drafts(head, states, tokens, num_drafts):
    """Medusa: head i on h_{T-2}, the newest hidden state the target computed, predicts x_{T+i}."""
    return head(states[-1][len(tokens) - 2]).argmax(-1)[:num_drafts].tolist()


# ---- random heads -------------------------------------------------------------------------------------


HEAD_CASES = [("medusa", "tiny_llama"), ("eagle", "tiny_qwen3"), ("eagle3", "tiny_llama"), ("mtp", "tiny_qwen3")]
# Targets of the other families the engine runs (a sparse MLP; sliding windows and Gemma's layer; a multimodal
# checkpoint's language model): speculative greedy outputs, chains and trees, equal plain decoding's there too.
FAMILY_CASES = [("eagle3", "tiny_qwen3_moe"), ("eagle", "tiny_gemma3"), ("eagle3", "tiny_gpt_oss"),
                ("eagle3", "tiny_gemma3_multimodal")]
SCENARIOS = {
    # one request at a time; prompts of up to 50 tokens prefill in chunks of 16
    1: dict(max_num_seqs=1, max_num_batched_tokens=16),
    # 8 requests that grow to 27-74 tokens in a pool of 40 blocks of 4 (160 slots): preemption by recompute;
    # a budget of 24 tokens per step chunks the prefills
    8: dict(max_num_seqs=8, max_num_batched_tokens=24, num_blocks=40, max_model_len=96),
}
PROMPTS = random_prompts(LENGTHS, seed=5)

_RANDOM_HEADS: dict = {}


def random_head_dir(kind, folder, root) -> str:
    key = (kind, str(folder))
    if key not in _RANDOM_HEADS:
        head = perturb(new_head(kind, target_parts(folder), seed=11), seed=12)
        _RANDOM_HEADS[key] = str(heads.save(head, root / f"{kind}-{folder.name}"))
    return _RANDOM_HEADS[key]


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("heads")


@dataclass
class Run:
    engine: Engine
    outputs: list
    proposals: list[Proposal]


_RUNS: dict = {}


def spec_run(kind, folder, concurrency, head_dir) -> Run:
    key = (kind, str(folder), concurrency)
    if key not in _RUNS:
        engine = make_engine(folder, spec_config(kind, head_dir), **SCENARIOS[concurrency])
        proposals = record_proposals(engine)
        _RUNS[key] = Run(engine, engine.generate(PROMPTS, greedy(MAX_TOKENS)), proposals)
    return _RUNS[key]


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind, fixture", HEAD_CASES + FAMILY_CASES, ids=[f"{k}-{f}" for k, f in HEAD_CASES + FAMILY_CASES])
def test_random_heads_reproduce_plain_greedy(kind, fixture, concurrency, heads_root, request):
    folder = request.getfixturevalue(fixture)
    run = spec_run(kind, folder, concurrency, random_head_dir(kind, folder, heads_root))
    expected = plain_outputs(folder, PROMPTS, MAX_TOKENS)
    for prompt, out, ref in zip(PROMPTS, run.outputs, expected):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverged from plain greedy decoding"
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
    assert_pool_idle(run.engine)
    stats = run.engine.speculator.stats
    assert sum(stats.proposed) > 0 and run.proposals, "the head never drafted: the case tests nothing"
    # a head drafter fills every budget it is given
    assert all(len(p.drafts) == p.budget for p in run.proposals)
    assert all(0 <= t < VOCAB for p in run.proposals for t in p.drafts)
    # every request drafted, from its first decode step on
    assert {p.request_id for p in run.proposals} == {o.request_id for o in run.outputs}
    assert max(LENGTHS) > SCENARIOS[concurrency]["max_num_batched_tokens"]  # chunked prefill happened
    if concurrency == 8:
        assert sum(o.metrics["num_preemptions"] for o in run.outputs) > 0, "no preemption: the pool is too roomy"


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind, fixture", HEAD_CASES + FAMILY_CASES, ids=[f"{k}-{f}" for k, f in HEAD_CASES + FAMILY_CASES])
def test_head_trees_reproduce_plain_greedy(kind, fixture, concurrency, heads_root, request):
    """topk 3, num_draft_tokens 8: each head drafts a tree of up to 7 nodes (its topk most likely children of the
    best nodes, depth by depth), verified whole under chunked prefill and preemption, and the outputs stay plain
    decoding's."""
    folder = request.getfixturevalue(fixture)
    spec = dict(spec_config(kind, random_head_dir(kind, folder, heads_root)), topk=3, num_draft_tokens=8)
    engine = make_engine(folder, spec, **SCENARIOS[concurrency])
    assert engine.speculator.config.max_draft_nodes == 7
    proposals = record_proposals(engine)
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_outputs(folder, PROMPTS, MAX_TOKENS)
    assert_pool_idle(engine)
    if concurrency == 8:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption: the pool is too roomy"
    assert proposals
    if concurrency == 1:  # alone, every request drafts; at 8 the first in running order take the token budget
        assert {p.request_id for p in proposals} == {o.request_id for o in outputs}
    for p in proposals:
        tree = p.tree
        # within the budget, and a head fills its nodes where the search made enough candidates (3 at depth 1, then
        # the 3 children of each of the 3 best nodes per depth)
        assert tree.depth <= p.budgets.depth, (tree.depth, p.budgets)
        assert len(tree) == min(p.budgets.num_nodes, 3 + 9 * (p.budgets.depth - 1)), (len(tree), p.budgets)
        assert all(0 <= t < VOCAB for t in tree.tokens)
        for siblings in tree.children:  # a node's children are distinct drafts, at most topk of them
            tokens = [tree.tokens[c] for c in siblings]
            assert len(tokens) <= 3 and len(set(tokens)) == len(tokens), tree
    assert any(len(tree.children[0]) == 3 for tree in (p.tree for p in proposals))
    assert any(p.tree.depth == min(K, p.budgets.depth) > 1 and not is_chain(p.tree) for p in proposals)
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > sum(stats.proposed), "trees verify more nodes than depths"


@pytest.mark.parametrize("kind, fixture, serve_mode", [*((k, f, None) for k, f in HEAD_CASES), ("mtp", "tiny_llama", "chain")],
                         ids=[*(k for k, _ in HEAD_CASES), "mtp-chain"])
def test_head_drafters_name_the_engines_device(kind, fixture, serve_mode, heads_root, request, device_unnamed_is_meta):
    """Every tensor a head drafter makes is on the engine's device: run with unnamed devices on meta, greedy and
    sampled requests with trees (topk 2) and the cut draft, accept and emit what the same run does on the CPU by default
    (a meta index into a CPU tensor reads garbage instead of failing, which only the drafts show)."""
    folder = request.getfixturevalue(fixture)
    if serve_mode:
        head = perturb(chain_mtp(folder, K), seed=12)
        head_dir = heads.save(head, heads_root / f"mtp-{serve_mode}-{folder.name}")
    else:
        head_dir = random_head_dir(kind, folder, heads_root)
    spec = dict(spec_config(kind, head_dir), confidence_threshold=0.001, topk=1 if serve_mode else 2)
    params = [greedy(12)] * 3 + [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]

    def run():
        engine = make_engine(folder, spec, device="cpu")
        proposals = record_proposals(engine)
        outputs = [o.token_ids for o in engine.generate(PROMPTS[:5], params)]
        return outputs, proposals, engine.speculator.stats.to_dict()

    expected = run()
    assert sum(len(p.drafts) for p in expected[1]) > 20, "the head barely drafted: the case tests nothing"
    if not serve_mode:
        assert any(not is_chain(p.tree) for p in expected[1]), "topk 2 drafted no tree"
    with device_unnamed_is_meta():
        assert run() == expected
    assert expected[0][:3] == [o[:12] for o in plain_outputs(folder, PROMPTS, MAX_TOKENS)[:3]]


# ---- paged equals dense ----------------------------------------------------------------------------------


def load_as_drafted(head_dir, folder, draft_weights="bfloat16"):
    """The head in head_dir, bound to the target in `folder`, with the weights the engine's drafter computes with:
    its own linear layers and the target's LM head (the rows of its token map, if it has one) rounded to
    draft_weights, int8 as each row's int8 values times its scale (the embedding stays as it is)."""
    def stored(weight):
        if draft_weights == "int8":
            quantized, scale = quantize_int8(weight)
            return quantized * scale[:, None]
        return weight.to(getattr(torch, draft_weights))

    parts = target_parts(folder)
    lm_head = torch.nn.Linear(parts.hidden_size, parts.vocab_size, bias=False).requires_grad_(False)
    lm_head.weight.copy_(stored(parts.lm_head.weight))
    token_map = heads.load(head_dir).token_map
    parts.lm_head = lm_head if token_map is None else lm_head_rows(lm_head, token_map)  # untied from the embedding
    head = heads.load(head_dir, target=parts).eval()
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(stored(module.weight))
    return head


def check_against_dense(folder, head, proposals, finals) -> tuple[int, list[str]]:
    """Every recorded proposal against dense_drafts (dense_medusa_drafts for Medusa); `finals` maps request ids
    to their final token ids (prompt + output). Returns (number checked, mismatch descriptions)."""
    states: dict = {}
    num_checked, mismatches = 0, []
    for p in proposals:
        assert is_chain(p.tree), "topk 1 drafts a chain"
        final = finals[p.request_id]
        assert p.token_ids == final[:len(p.token_ids)], "the proposal's tokens are not a prefix of the output"
        if p.request_id not in states:
            states[p.request_id] = hf_hidden_states(folder, final)  # causal: every prefix's states at once
        if head.config.kind == "medusa":
            dense, margins = dense_medusa_drafts(head, states[p.request_id], p.token_ids, len(p.drafts)), []
        else:
            dense, margins, _ = dense_drafts(head, states[p.request_id], p.token_ids, len(p.drafts))
        num_checked += 1
        if dense != p.drafts:
            mismatches.append(f"request {p.request_id} at T={len(p.token_ids)}: paged {p.drafts}, dense {dense} "
                              f"(dense top-2 margins {[round(m, 5) for m in margins]})")
    return num_checked, mismatches


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind, fixture", HEAD_CASES, ids=[f"{k}-{f}" for k, f in HEAD_CASES])
def test_paged_drafts_equal_dense_drafts(kind, fixture, concurrency, heads_root, request):
    """Every proposal of the runs of test_random_heads_reproduce_plain_greedy (chunked prefill; at concurrency
    8 also preemption) against the dense reference. Medusa has no K/V: its proposals are checked against the
    head on h_{T-2}."""
    folder = request.getfixturevalue(fixture)
    head_dir = random_head_dir(kind, folder, heads_root)
    run = spec_run(kind, folder, concurrency, head_dir)
    head = load_as_drafted(head_dir, folder)
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in run.outputs}
    num_checked, mismatches = check_against_dense(folder, head, run.proposals, finals)
    assert num_checked >= 8 * 4
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("fields", [{}, {"norm_before_residual": True, "norm_output": True, "own_embedding": True},
                                    {"draft_window": 6}], ids=["eagle3", "eagle3.1-norms-own-embedding", "window"])
def test_eagle3_s_forward_in_one_call_equals_the_module(fields, tiny_llama, tmp_path):
    """serving.kernels.Eagle3Forward (kernels.c's eagle3_forward) against the module it replaces, on the drafter's
    pool: the same output bit for bit, and the same K/V written over the module's, over a catch-up's rows and a
    draft's, with EAGLE 3.1's norms and an own embedding, and with a draft window."""
    head = perturb(new_head("eagle3", target_parts(tiny_llama), seed=11, **fields), seed=12)
    engine = make_engine(tiny_llama, spec_config("eagle3", heads.save(head, tmp_path / "eagle3")))
    drafter, runner = engine.speculator.drafter, engine.runner
    if drafter.one_call is None:
        pytest.skip("the kernels do not compute the head's layer here")
    g = torch.Generator().manual_seed(3)
    for rows, context in ((9, 9), (1, 10), (4, 14)):
        ids = torch.randint(0, VOCAB, (rows,), generator=g)
        features = torch.randn(rows, head.config.hidden_size, generator=g)
        positions = torch.arange(context - rows, context)
        meta = runner.metadata([rows], [context], [[3, 5, 7, 8]])
        module = drafter.head(ids, features, positions, PagedAttention(drafter.cache, meta))
        k, v = drafter.cache.k.clone(), drafter.cache.v.clone()
        one_call = drafter.one_call(ids, features, positions, PagedAttention(drafter.cache, meta))
        assert torch.equal(one_call, module)
        assert torch.equal(drafter.cache.k, k) and torch.equal(drafter.cache.v, v)  # the same K/V written over it


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_draft_weights_draft_what_the_dense_head_over_them_drafts(kind, weights, tiny_llama, heads_root):
    """draft_weights "float32" keeps the head's weights as trained, "int8" stores each row as int8 over a scale of
    its own: proposals equal the dense head's over those weights exactly, and some of them differ from the default
    bfloat16 drafter's (the rounding is real), while both runs' outputs are plain greedy decoding's."""
    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    runs = {}
    for stored in (weights, "bfloat16"):
        engine = make_engine(tiny_llama, dict(spec_config(kind, head_dir), draft_weights=stored))
        proposals = record_proposals(engine)
        outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
        assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, PROMPTS, MAX_TOKENS)
        runs[stored] = proposals
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    num_checked, mismatches = check_against_dense(tiny_llama, load_as_drafted(head_dir, tiny_llama, weights),
                                                  runs[weights], finals)
    assert num_checked >= 8 * 4 and not mismatches, mismatches[:5]
    assert [p.drafts for p in runs[weights]] != [p.drafts for p in runs["bfloat16"]]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_paged_drafts_equal_dense_drafts_after_prefix_cache_hits(kind, tiny_llama, heads_root):
    """A first request leaves 3 full blocks (12 tokens) in the prefix cache. The head's entry at position 11
    pairs h_11 with x_12, so a block is shared only when the token after it matches too: 6 requests that
    share 12 tokens and continue differently reuse 2 blocks, 6 that share 13 tokens reuse all 3."""
    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    shared = random_prompts([12], seed=41)[0]
    first = shared + random_prompts([3], seed=42)[0]
    tails = random_prompts((1, 2, 5, 9, 4, 7), seed=43)
    prompts = [shared + tail for tail in tails] + [first[:13] + tail for tail in tails]
    engine = make_engine(tiny_llama, spec_config(kind, head_dir))
    proposals = record_proposals(engine)
    warm = engine.generate([first], greedy(8))
    outputs = engine.generate(prompts, greedy(8))
    assert [o.metrics["num_cached_tokens"] for o in outputs] == [8] * 6 + [12] * 6
    assert [o.token_ids for o in warm + outputs] == plain_outputs(tiny_llama, [first] + prompts, 8)
    head = load_as_drafted(head_dir, tiny_llama)
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in warm + outputs}
    num_checked, mismatches = check_against_dense(tiny_llama, head, proposals, finals)
    assert num_checked >= 7 * 2
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_a_head_that_skips_steps_catches_up_when_it_next_drafts(kind, tiny_llama, heads_root):
    """Requests draft only at their first output token and every 16th after (the others get no budget, as the
    adaptive policy often chooses), so the head's catch-up over the pairs kept meanwhile waits until a request
    drafts again and then runs in one forward: its drafts equal the dense head's. A request that arrives while A's
    pairs from position 19 on are pending shares all 28 tokens of A's blocks it matches (as plain decoding would), and
    its first catch-up runs the head over A's pending pairs in those blocks before its own: it drafts as the dense
    head does. A finishing request leaves its pending pairs with the blocks it registers, so the next request that
    shares them drafts the dense drafts as well."""
    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    engine = make_engine(tiny_llama, spec_config(kind, head_dir), max_num_seqs=4)
    assert engine.block_size == 4
    grant = engine.scheduler.draft_room
    engine.scheduler.draft_room = lambda requests, most: {
        rid: n if r.num_output_tokens % 16 == 1 else 0 for r, (rid, n) in zip(requests, grant(requests, most).items())}
    proposals = record_proposals(engine)
    a = engine.add_request(PROMPTS[3], greedy(24))  # 18 prompt tokens
    while engine.requests[a].num_output_tokens < 14:
        engine.step()
    tails = random_prompts((5, 3), seed=44)
    b = engine.add_request(engine.requests[a].token_ids[:30] + tails[0], greedy(8))
    added = [engine.requests[a], engine.requests[b]]
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    done_a = next(o for o in finished if o.request_id == a)
    # A drafted last at output 17: its pairs from position 35 on were pending when it finished
    c = engine.add_request((done_a.prompt_token_ids + done_a.token_ids)[:41] + tails[1], greedy(8))
    added.append(engine.requests[c])
    while engine.has_unfinished():
        finished += engine.step()
    outputs = {o.request_id: o for o in finished}
    cached = {rid: outputs[rid].metrics["num_cached_tokens"] for rid in (a, b, c)}
    assert cached == {a: 0, b: 28, c: 40}, "b and c share every block of A's they match"
    prompts = [outputs[rid].prompt_token_ids for rid in (a, b, c)]
    assert [outputs[rid].token_ids for rid in (a, b, c)] == [plain_outputs(tiny_llama, [p], n)[0]
                                                             for p, n in zip(prompts, (24, 8, 8))]
    assert not any(r.spec.slots for r in added), "a finished request left state behind"
    head = load_as_drafted(head_dir, tiny_llama)
    finals = {rid: o.prompt_token_ids + o.token_ids for rid, o in outputs.items()}
    num_checked, mismatches = check_against_dense(tiny_llama, head, proposals, finals)
    assert {p.request_id for p in proposals} == {a, b, c} and num_checked >= 4
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_heads_that_draft_now_and_then_share_blocks_through_preemption_as_the_dense_head_drafts(kind, tiny_llama,
                                                                                                 heads_root):
    """Eight requests draft only at every 5th output token, in a pool small enough to preempt them, half of them
    sharing a prompt prefix with another: blocks are registered while their pairs are pending, shared, dropped by
    preemption and taken again on recompute. Every proposal equals the dense head's (the head's pool is whole
    wherever it drafts from), outputs equal plain decoding's, and requests did run the head over pairs that blocks
    they shared had kept."""
    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    prompts = PROMPTS[2:6] + [p[:13] + tail for p, tail in zip(PROMPTS[2:6], random_prompts((3, 9, 6, 12), seed=46))]
    engine = make_engine(tiny_llama, spec_config(kind, head_dir), **SCENARIOS[8])
    grant = engine.scheduler.draft_room
    engine.scheduler.draft_room = lambda requests, most: {
        rid: n if r.num_output_tokens % 5 == 1 else 0 for r, (rid, n) in zip(requests, grant(requests, most).items())}
    drafter = engine.speculator.drafter
    taken = []
    unrun_pairs = drafter._unrun_pairs
    drafter._unrun_pairs = lambda request: taken.append(unrun_pairs(request)) or taken[-1]
    proposals = record_proposals(engine)
    outputs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, prompts, MAX_TOKENS)
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption: the pool is too roomy"
    assert sum(o.metrics["num_cached_tokens"] for o in outputs) > 0
    assert any(taken), "no request ran the head over pairs a shared block kept"
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    num_checked, mismatches = check_against_dense(tiny_llama, load_as_drafted(head_dir, tiny_llama), proposals, finals)
    assert num_checked >= 8
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_a_prompt_is_shared_while_its_request_does_not_draft(kind, tiny_llama, heads_root):
    """Nothing drafts, so the head never runs, yet a request arriving while A decodes shares A's prompt blocks (12 of
    the 16 tokens they share: a block's hash covers the token after it) as it would with plain decoding, and both
    decode as plain decoding does."""
    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    engine = make_engine(tiny_llama, spec_config(kind, head_dir), max_num_seqs=4)
    engine.scheduler.draft_room = lambda requests, most: {r.request_id: 0 for r in requests}
    drafter = engine.speculator.drafter
    num_head_calls = []
    head_forward = drafter._forward
    drafter._forward = lambda *args: num_head_calls.append(1) or head_forward(*args)
    a = engine.add_request(PROMPTS[3], greedy(12))  # 18 prompt tokens
    while engine.requests[a].num_output_tokens < 3:
        engine.step()
    b = engine.add_request(PROMPTS[3][:16] + random_prompts((5,), seed=45)[0], greedy(6))
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    outputs = {o.request_id: o for o in finished}
    assert outputs[b].metrics["num_cached_tokens"] == 12
    assert engine.speculator.stats.num_draft_tokens == 0 and not num_head_calls
    for rid, n in ((a, 12), (b, 6)):
        assert outputs[rid].token_ids == plain_outputs(tiny_llama, [outputs[rid].prompt_token_ids], n)[0]


def test_paged_drafts_equal_dense_drafts_when_the_prefix_was_cached_before_the_head(tiny_llama, heads_root):
    """Blocks cached by plain decoding, then set_speculative_config switches an EAGLE head on: the head's pool
    holds nothing for them, so the switch forgets the prefix cache and the request drafts from K/V it wrote."""
    head_dir = random_head_dir("eagle", tiny_llama, heads_root)
    prompt = random_prompts([21], seed=44)[0]
    engine = make_engine(tiny_llama)
    engine.generate([prompt[:17]], greedy(4))  # leaves 4 full blocks of the prompt in the prefix cache
    engine.set_speculative_config(spec_config("eagle", head_dir))
    proposals = record_proposals(engine)
    out = engine.generate([prompt], greedy(12))[0]
    assert out.metrics["num_cached_tokens"] == 0
    assert out.token_ids == plain_outputs(tiny_llama, [prompt], 12)[0]
    head = load_as_drafted(head_dir, tiny_llama)
    num_checked, mismatches = check_against_dense(tiny_llama, head, proposals,
                                                  {out.request_id: out.prompt_token_ids + out.token_ids})
    assert num_checked >= 3
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])


# ---- oracle: heads fitted to the target's own continuations draft them back ------------------------------


ORACLE_VOCAB = 64
ORACLE_NEW_TOKENS = 40
ORACLE_PROMPTS = random_prompts((8, 13), seed=21, vocab=ORACLE_VOCAB)


@dataclass
class Sequence:
    tokens: torch.Tensor  # [N] prompt + greedy output
    num_prompt: int
    hidden: torch.Tensor  # [N, hidden] after the final norm, from the engine's forward
    aux: dict  # layer -> [N, hidden], the input of that layer


@dataclass
class Oracle:
    folder: object
    sequences: list[Sequence]
    outputs: list[list[int]]  # plain greedy outputs of ORACLE_PROMPTS
    root: object
    trained: dict = field(default_factory=dict)  # kind -> (head, head_dir, train accuracy, train seconds)
    served: dict = field(default_factory=dict)  # kind -> Run


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A tiny Llama with a 64-token vocabulary, and its greedy answers to ORACLE_PROMPTS with the hidden states
    the engine computed for every token (capture_hidden: the same pass that answers). initializer_range 0.3
    makes the answers varied, text-like (26-28 distinct tokens in 40, no constant runs or short loops), so
    a draft shifted by one position is wrong: with the default 0.02 a tiny model repeats one token, and a
    shifted draft would be accepted anyway."""
    folder = build_tiny_model(tmp_path_factory.mktemp("oracle_target"), "llama", vocab_size=ORACLE_VOCAB, seed=0,
                              initializer_range=0.3)
    engine = make_engine(folder, capture_hidden=True, aux_layers=EAGLE3_AUX)
    captured = engine.generate(ORACLE_PROMPTS, greedy(ORACLE_NEW_TOKENS))
    sequences = [Sequence(torch.tensor(o.prompt_token_ids + o.token_ids), len(o.prompt_token_ids), o.hidden, o.aux)
                 for o in captured]
    for o in captured:  # the premise of the oracle: a draft one position off would be rejected
        repeats = sum(x == y for x, y in zip(o.token_ids, o.token_ids[1:])) + sum(
            x == y for x, y in zip(o.token_ids, o.token_ids[2:]))
        assert len(set(o.token_ids)) >= 20 and repeats <= 4, o.token_ids
    return Oracle(folder, sequences, [o.token_ids for o in captured], tmp_path_factory.mktemp("oracle_heads"))


class UnrolledAttention:
    """Attention of one unrolled draft step s over M anchors (the engine's drafting, for all anchors at once):
    query row p (anchor p, position p + s) sees the step-0 entries of anchors <= p (the real positions the
    engine's pool holds after catch-up) and its own anchor's entries of steps 1..s (the drafts it fed).
    Call it once per step, in order; one decoder layer."""

    def __init__(self, num_anchors: int):
        self.num_anchors = num_anchors
        self.k, self.v = [], []

    def __call__(self, layer_idx, q, k, v):
        self.k.append(k)
        self.v.append(v)
        m = self.num_anchors
        blocks = [torch.ones(m, m, dtype=torch.bool).tril()] + [torch.eye(m, dtype=torch.bool)] * (len(self.k) - 1)
        return sdpa_gqa(q, torch.cat(self.k, 1), torch.cat(self.v, 1), torch.cat(blocks, 1)[None])


def unrolled_loss(head, seq: Sequence, num_steps: int, target_index=None):
    """Cross-entropy of steps 0..num_steps-1 of the engine's draft loop at every anchor p >= num_prompt - 1
    (the first anchor the engine drafts from is the last prompt position): step s at anchor p reads
    (x_{p+1+s}, step s-1's output; step 0: the target's feature h_p) at position p + s and predicts x_{p+2+s}.
    Returns (loss, number right, number of predictions)."""
    x = seq.tokens
    n = len(x)
    m = n - 1  # anchors 0..n-2
    features = head_features(head, {**seq.aux, -1: seq.hidden}, m)
    attention = UnrolledAttention(m)
    anchors = torch.arange(m)
    loss, right, count = 0.0, 0, 0
    for s in range(num_steps):
        ids = torch.zeros(m, dtype=torch.long)
        ids[:m - s] = x[1 + s:]
        out = head_forward(head, ids[None], features[None], (anchors + s)[None], attention)[0]
        rows = anchors[(anchors >= seq.num_prompt - 1) & (anchors <= m - 2 - s)]
        labels = x[rows + 2 + s]
        if target_index is not None:
            labels = target_index[labels]
        logits = head_logits(head, out[rows])
        loss = loss + F.cross_entropy(logits, labels, reduction="sum")
        right += int((logits.argmax(-1) == labels).sum())
        count += len(rows)
        features = out
    return loss, right, count


def medusa_loss(head, seq: Sequence):
    """Head i on h_t predicts x_{t+2+i}, at every t >= num_prompt - 1 (the engine's first Medusa proposal reads
    h of the last prompt position)."""
    logits = head(seq.hidden)  # [K, N, vocab]
    x, n = seq.tokens, len(seq.tokens)
    loss, right, count = 0.0, 0, 0
    for i in range(head.config.num_heads):
        rows = torch.arange(seq.num_prompt - 1, n - 2 - i)
        labels = x[rows + 2 + i]
        loss = loss + F.cross_entropy(logits[i, rows], labels, reduction="sum")
        right += int((logits[i, rows].argmax(-1) == labels).sum())
        count += len(rows)
    return loss, right, count


def overfit(head, sequences, *, max_steps, lr, seconds):
    """AdamW on the summed loss of all sequences until every prediction is right with a margin (mean loss
    below 0.02), `max_steps` or `seconds`. Returns the final training accuracy."""
    kind = head.config.kind
    target_index = None
    if kind == "eagle3":
        target_index = torch.full((head.config.vocab_size,), -100, dtype=torch.long)
        target_index[head.draft_token_ids] = torch.arange(head.config.draft_vocab_size)
    head.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    start = time.perf_counter()
    accuracy = 0.0
    for _ in range(max_steps):
        loss, right, count = 0.0, 0, 0
        for seq in sequences:
            if kind == "medusa":
                part = medusa_loss(head, seq)
            else:
                part = unrolled_loss(head, seq, K, target_index)
            loss, right, count = loss + part[0], right + part[1], count + part[2]
        accuracy = right / count
        if accuracy == 1.0 and loss.item() / count < 0.02 or time.perf_counter() - start > seconds:
            break
        optimizer.zero_grad()
        (loss / count).backward()
        optimizer.step()
    head.eval().requires_grad_(False)
    return accuracy


def trained_head(oracle: Oracle, kind):
    """The head of `kind` fitted on the oracle's sequences, and its checkpoint folder; memoized."""
    if kind not in oracle.trained:
        parts = target_parts(oracle.folder)
        answer_tokens = sorted({t for seq in oracle.sequences for t in seq.tokens[seq.num_prompt:].tolist()})
        # EAGLE-3's reduced vocabulary: every answer token, plus others up to 3/4 of the target's vocabulary
        others = [t for t in torch.randperm(ORACLE_VOCAB, generator=torch.Generator().manual_seed(0)).tolist()
                  if t not in answer_tokens]
        draft_vocab = answer_tokens + others[:max(0, 3 * ORACLE_VOCAB // 4 - len(answer_tokens))]
        head = new_head(kind, parts, seed=31, draft_vocab=draft_vocab, own_lm_head=True)
        if kind == "mtp":
            perturb(head.blocks[1], seed=32)  # module 1 stays untrained: serving must not use it
        start = time.perf_counter()
        lr = 1e-2 if kind == "medusa" else 3e-3
        accuracy = overfit(head, oracle.sequences, max_steps=600, lr=lr, seconds=25)
        head_dir = heads.save(head, oracle.root / kind)
        oracle.trained[kind] = (head, head_dir, accuracy, time.perf_counter() - start)
    return oracle.trained[kind]


def oracle_serve(oracle: Oracle, kind, head_dir=None) -> Run:
    """Serve the oracle prompts with the trained head (or the head in `head_dir`); memoized for the former."""
    if head_dir is None and kind in oracle.served:
        return oracle.served[kind]
    folder = head_dir or trained_head(oracle, kind)[1]
    engine = make_engine(oracle.folder, spec_config(kind, folder))
    proposals = record_proposals(engine)
    run = Run(engine, engine.generate(ORACLE_PROMPTS, greedy(ORACLE_NEW_TOKENS)), proposals)
    if head_dir is None:
        oracle.served[kind] = run
    return run


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_heads_draft_the_targets_own_continuation(kind, oracle):
    head, head_dir, accuracy, seconds = trained_head(oracle, kind)
    assert accuracy >= 0.99, f"the {kind} overfit reached only {accuracy:.3f} training accuracy in {seconds:.1f} s"
    run = oracle_serve(oracle, kind)
    for out, ref in zip(run.outputs, oracle.outputs):
        assert out.token_ids == ref
    stats = run.engine.speculator.stats
    print(f"\noracle {kind}: training accuracy {accuracy:.3f} in {seconds:.1f} s, tau {stats.tau:.2f} "
          f"(k={K}), acceptance rate {stats.acceptance_rate:.3f}, accepted per position {stats.accepted} "
          f"of {stats.proposed}")
    # perfect drafts: 39 tokens after the prefill's, 4 per verify step -> tau 3.9; a one-position shift -> ~1
    # EAGLE's token input is redundant with h on greedy data (x_{p+1} = argmax lm_head(h_p)), so a head fitted
    # here can draft right with a catch-up that pairs h_p with the wrong token, and tau alone misses it; the
    # acceptance rate does not (test_paged_drafts_equal_dense_drafts catches it exactly)
    assert stats.acceptance_rate >= 0.97, f"{kind}: accepted per position {stats.accepted} of {stats.proposed}"
    assert stats.tau >= 0.8 * (K + 1), (f"{kind}: tau {stats.tau:.2f} despite {accuracy:.3f} training accuracy; "
                                        f"accepted per position {stats.accepted} of {stats.proposed}")
    assert_pool_idle(run.engine)


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_heads_draft_the_same_after_chunked_prefill(kind, oracle):
    """One request at a time, prompts prefilled in chunks of 5 tokens: steps in which no request drafts (the
    chunks before the last) must still reach the head's pool, so every proposal equals the unchunked run's."""
    _, head_dir, _, _ = trained_head(oracle, kind)
    engine = make_engine(oracle.folder, spec_config(kind, head_dir), max_num_seqs=1, max_num_batched_tokens=5)
    proposals = record_proposals(engine)
    outputs = engine.generate(ORACLE_PROMPTS, greedy(ORACLE_NEW_TOKENS))
    assert [o.token_ids for o in outputs] == oracle.outputs
    unchunked = oracle_serve(oracle, kind)
    assert sorted((p.token_ids, p.drafts) for p in proposals) == sorted((p.token_ids, p.drafts)
                                                                        for p in unchunked.proposals)
    assert engine.speculator.stats.tau == unchunked.engine.speculator.stats.tau


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_heads_under_preemption_and_chunked_prefill(kind, oracle):
    """Accepted runs, rollback, preemption and chunked prefill together: the oracle prompts (mostly accepted
    drafts) beside 4 other prompts (mostly rejected) in a tight pool; outputs stay plain greedy's."""
    _, head_dir, _, _ = trained_head(oracle, kind)
    prompts = ORACLE_PROMPTS + random_prompts((21, 5, 30, 17), seed=22, vocab=ORACLE_VOCAB)
    expected = plain_outputs(oracle.folder, prompts, ORACLE_NEW_TOKENS)
    engine = make_engine(oracle.folder, spec_config(kind, head_dir), num_blocks=36, max_model_len=80,
                         max_num_batched_tokens=20)
    outputs = engine.generate(prompts, greedy(ORACLE_NEW_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    stats = engine.speculator.stats
    assert sum(stats.accepted) > 0 and sum(stats.accepted) < sum(stats.proposed)
    # the heads' own prompts: whatever the budget cut, every draft proposed is the target's continuation
    rates = [o.metrics["spec"]["acceptance_rate"] for o in outputs[:len(ORACLE_PROMPTS)]]
    print(f"\n{kind} under pressure: acceptance rate of the oracle prompts {rates}, others "
          f"{[round(o.metrics['spec']['acceptance_rate'], 2) for o in outputs[len(ORACLE_PROMPTS):]]}")
    assert min(rates) >= 0.95, f"{kind}: acceptance rate of the oracle prompts {rates}"
    assert_pool_idle(engine)


# ---- checkpoint round trip --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_drafts_identically(kind, oracle, tmp_path):
    head, head_dir, _, _ = trained_head(oracle, kind)
    loaded = heads.load(head_dir, targets.fingerprint(oracle.folder))
    assert type(loaded) is type(head) and loaded.config == head.config
    own, back = head.state_dict(), loaded.state_dict()
    assert own.keys() == back.keys()
    for name in own:
        assert torch.equal(own[name], back[name]), name
    again = heads.save(loaded, tmp_path / "again")
    first, second = oracle_serve(oracle, kind), oracle_serve(oracle, kind, head_dir=again)
    assert [(p.token_ids, p.drafts) for p in second.proposals] == [(p.token_ids, p.drafts) for p in first.proposals]
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    a, b = first.engine.speculator.stats, second.engine.speculator.stats
    assert (b.tau, b.accepted, b.proposed) == (a.tau, a.accepted, a.proposed)


# ---- clear errors ----------------------------------------------------------------------------------------


def test_head_for_another_target_is_a_clear_error(tiny_llama, tiny_qwen3, heads_root, tmp_path):
    llama_head = random_head_dir("eagle", tiny_llama, heads_root)
    with pytest.raises(ValueError, match="made for another target") as info:
        make_engine(tiny_qwen3, spec_config("eagle", llama_head))
    assert "architecture" in str(info.value) and "llama" in str(info.value) and "qwen3" in str(info.value)
    # same family and sizes but one more layer: a different fingerprint too
    deeper = build_tiny_model(tmp_path / "deeper", "llama", num_hidden_layers=5)
    with pytest.raises(ValueError, match="made for another target") as info:
        make_engine(deeper, spec_config("eagle", llama_head))
    assert "num_layers" in str(info.value)


@pytest.mark.parametrize("method, kind", [("eagle", "medusa"), ("medusa", "eagle"), ("mtp", "eagle3"),
                                          ("eagle3", "eagle")])
def test_method_and_head_kind_mismatch_is_a_clear_error(method, kind, tiny_llama, heads_root):
    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    with pytest.raises(ValueError, match=rf"holds a head of kind '{kind}'.*method '{method}'") as info:
        make_engine(tiny_llama, spec_config(method, head_dir))
    assert f'"method": "{kind}"' in str(info.value)


def test_more_medusa_drafts_than_heads_is_a_clear_error(tiny_llama, heads_root):
    head_dir = random_head_dir("medusa", tiny_llama, heads_root)
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={K + 1} exceeds .* {K} heads"):
        make_engine(tiny_llama, spec_config("medusa", head_dir, k=K + 1))
    make_engine(tiny_llama, spec_config("medusa", head_dir, k=K))  # exactly num_heads is fine


def test_mtp_chain_mode_is_a_clear_error(tiny_llama, tmp_path):
    head = chain_mtp(tiny_llama, 2)
    head_dir = heads.save(head, tmp_path / "mtp-chain")
    with pytest.raises(ValueError, match="reuse_first"):
        make_engine(tiny_llama, spec_config("mtp", head_dir))


def test_trees_from_an_mtp_chain_are_a_clear_error(tiny_llama, tmp_path):
    head = chain_mtp(tiny_llama, 2)
    head_dir = heads.save(head, tmp_path / "mtp-chain")
    with pytest.raises(ValueError, match=r"draft trees \(topk > 1\) apply to MTP heads with serve_mode 'reuse_first'"):
        make_engine(tiny_llama, dict(spec_config("mtp", head_dir, k=2), topk=2))


# ---- MTP served as a chain: module j drafts token j + 1 --------------------------------------------------


@torch.no_grad()
def dense_chain_drafts(head, states, tokens, num_drafts):
    """Module s over every position t in [0, T-2] with the pairs (h^s_t, y_{t+s+1}), y = tokens then the drafts
    so far, dense causal attention (within the head's draft_window); draft s + 1 from its output at T-2. h^0 is the
    target's final hidden state. Returns the drafts and their logits."""
    T = len(tokens)
    y, features, drafts, all_logits = list(tokens), states[-1][:T - 1], [], []
    for s in range(num_drafts):
        out = head.forward_module(s, torch.tensor(y[s + 1:T + s])[None], features[None], torch.arange(T - 1)[None],
                                  DenseCausalAttention(window=head.config.draft_window))[0]  # [T-1, hidden]
        logits = head.logits(s, out[-1])
        token = int(logits.argmax())
        drafts.append(token)
        all_logits.append(logits)
        y.append(token)
        features = out
    return drafts, all_logits


@pytest.mark.parametrize("concurrency, num_blocks, draft_window", [(1, 64, 0), (8, 48, 0), (8, 48, 5)])
def test_mtp_chain_drafts_equal_dense_chain_and_outputs_equal_plain(tiny_llama, heads_root, concurrency, num_blocks,
                                                                    draft_window):
    """Module j drafts token j + 1 as the dense chain does (with draft_window 5: every module's pooled K/V within
    it), and greedy outputs stay plain decoding's under preemption."""
    head = perturb(chain_mtp(tiny_llama, K, draft_window), seed=13)
    head_dir = str(heads.save(head, heads_root / f"mtp-chain-{draft_window}"))
    prompts = random_prompts([5, 23, 9, 40, 3, 17, 31, 12][:concurrency], seed=45)
    engine = make_engine(tiny_llama, spec_config("mtp", head_dir), num_blocks=num_blocks, max_num_batched_tokens=24)
    proposals = record_proposals(engine)
    outputs = engine.generate(prompts, greedy(20))
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, prompts, 20)
    if concurrency == 8:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    preempted = {o.request_id for o in outputs if o.metrics["num_preemptions"]}
    loaded = load_as_drafted(head_dir, tiny_llama)
    checked = [p for p in proposals if p.request_id not in preempted]
    assert len(checked) >= 4 * min(concurrency, 4) and all(len(p.drafts) <= K for p in proposals)
    mismatches = [(p.request_id, len(p.token_ids), p.drafts, dense)
                  for p in checked
                  if p.drafts != (dense := dense_chain_drafts(loaded, hf_hidden_states(tiny_llama, finals[p.request_id]),
                                                              p.token_ids, len(p.drafts))[0])]
    assert not mismatches, mismatches[:5]


def test_speculators_reused_across_switches_draft_as_the_dense_reference(tiny_llama, heads_root):
    """A bench builds each speculator once and switches among them per group of prompts (Engine.use_speculator).
    EAGLE-1, EAGLE-3 and a chained MTP head (whose drafter carries outputs between steps) take turns with plain
    decoding over two rounds, the second on the first round's prompts extended. EAGLE-1 and EAGLE-3 hash blocks
    alike (the token after a block is part of its key), so had a switch kept the prefix cache, one would draft
    from blocks the other's pool wrote. Every proposal equals the dense reference, every output plain greedy
    decoding's."""
    chain = perturb(chain_mtp(tiny_llama, K), seed=13)
    dirs = {"eagle": random_head_dir("eagle", tiny_llama, heads_root),
            "eagle3": random_head_dir("eagle3", tiny_llama, heads_root),
            "mtp": str(heads.save(chain, heads_root / "mtp-chain-reused"))}
    engine = make_engine(tiny_llama)
    speculators = {kind: Speculator(engine, SpeculativeConfig.from_json(spec_config(kind, d))) for kind, d in dirs.items()}
    proposals = {}
    for kind, speculator in speculators.items():
        engine.use_speculator(speculator)
        proposals[kind] = record_proposals(engine)
    first = random_prompts((14, 21), seed=46)
    rounds = [first, [p + t for p, t in zip(first, random_prompts((5, 9), seed=47))]]
    outputs = {kind: [] for kind in speculators}
    for prompts in rounds:
        for kind, speculator in [("plain", None), *speculators.items()]:
            engine.use_speculator(speculator)
            out = engine.generate(prompts, greedy(12))
            assert [o.token_ids for o in out] == plain_outputs(tiny_llama, prompts, 12)
            if speculator:
                outputs[kind] += out
    assert not any(o.metrics["num_cached_tokens"] for kind in outputs for o in outputs[kind])
    for kind, d in dirs.items():
        loaded = load_as_drafted(d, tiny_llama)
        finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs[kind]}
        assert len(proposals[kind]) >= 4 * 4
        if kind == "mtp":
            mismatches = [p for p in proposals[kind]
                          if p.drafts != dense_chain_drafts(loaded, hf_hidden_states(tiny_llama, finals[p.request_id]),
                                                            p.token_ids, len(p.drafts))[0]]
        else:
            _, mismatches = check_against_dense(tiny_llama, loaded, proposals[kind], finals)
        assert not mismatches, (kind, mismatches[:5])


def test_mtp_chain_refuses_more_drafts_than_modules(tiny_llama, heads_root):
    head = chain_mtp(tiny_llama, 2)
    head_dir = str(heads.save(head, heads_root / "mtp-chain-2"))
    with pytest.raises(ValueError, match="exceeds this MTP head's depth 2"):
        make_engine(tiny_llama, spec_config("mtp", head_dir, k=3))


# ---- a confidence threshold ends chains early ------------------------------------------------------------

TEMPERATURES = [1.7, 0.6, 1.3]  # confidence_temperatures of the heads the cut is tested with


def calibrated_head_dir(kind, folder, root) -> str:
    """random_head_dir's head with fitted temperatures in its config.json, as a fit writes them."""
    head = heads.load(random_head_dir(kind, folder, root), target=target_parts(folder))
    head.config.confidence_temperatures = list(TEMPERATURES)
    return str(heads.save(head, root / f"{kind}-{folder.name}-calibrated"))


def median_confidence(folder, head_dir, kind, monkeypatch) -> float:
    """The median probability (at the first draft's temperature) the head gives its drafts in a run without a
    threshold."""
    from serving.drafters import eagle, medusa, mtp

    seen, top = [], eagle.top_log_probs

    def spy(logits, *args):
        seen.extend((logits.float() / TEMPERATURES[0]).softmax(-1).amax(-1).flatten().tolist())
        return top(logits, *args)

    for module in (eagle, medusa, mtp):  # each head drafter reads its drafts' probabilities through top_log_probs
        assert module.top_log_probs is top
        monkeypatch.setattr(module, "top_log_probs", spy)
    make_engine(folder, spec_config(kind, head_dir), **SCENARIOS[1]).generate(PROMPTS, greedy(MAX_TOKENS))
    monkeypatch.undo()
    assert seen, "the spy saw no draft"
    return float(torch.tensor(seen).median())


def expected_cut(logits, threshold: float) -> int | None:
    """How many drafts a chain keeps: those before the first whose chain probability, the product of
    softmax(logits_i / T_i)[argmax], is below the threshold; None when a product lies within float error of it."""
    chain_p = 1.0
    for i, row in enumerate(logits):
        chain_p *= float((row.double() / TEMPERATURES[i]).softmax(-1).max())
        if abs(chain_p - threshold) < 1e-4 * threshold:
            return None
        if chain_p < threshold:
            return i
    return len(logits)


@pytest.mark.parametrize("kind, fixture", HEAD_CASES, ids=[f"{k}-{f}" for k, f in HEAD_CASES])
def test_a_confidence_threshold_cuts_chains_where_their_probability_falls_below_it(kind, fixture, heads_root, request,
                                                                                 monkeypatch):
    """With confidence_threshold at the median confidence of the head's first drafts, each proposal is the
    dense reference's chain up to the first draft where the product of the head's probabilities at its config's
    temperatures falls below the threshold; some are cut short and some are not, and outputs stay plain greedy
    decoding's."""
    folder = request.getfixturevalue(fixture)
    head_dir = calibrated_head_dir(kind, folder, heads_root)
    threshold = median_confidence(folder, head_dir, kind, monkeypatch)
    engine = make_engine(folder, dict(spec_config(kind, head_dir), confidence_threshold=threshold), **SCENARIOS[1])
    proposals = record_proposals(engine)
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_outputs(folder, PROMPTS, MAX_TOKENS)
    assert_pool_idle(engine)
    cut = [p for p in proposals if len(p.drafts) < p.budget]
    assert cut and len(cut) < len(proposals), f"{len(cut)} of {len(proposals)} proposals cut: the threshold tests nothing"
    head = load_as_drafted(head_dir, folder)
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    num_checked, mismatches = check_against_dense(folder, head, proposals, finals)
    assert num_checked == len(proposals) and not mismatches, mismatches[:5]
    num_compared, wrong = 0, []
    for p in proposals:
        states = hf_hidden_states(folder, finals[p.request_id])
        if kind == "medusa":
            with torch.no_grad():
                logits = list(head(states[-1][len(p.token_ids) - 2])[:p.budget])
        else:
            logits = dense_drafts(head, states, p.token_ids, p.budget)[2]
        expected = expected_cut(logits, threshold)
        num_compared += expected is not None
        if expected is not None and expected != len(p.drafts):
            wrong.append((p.request_id, len(p.token_ids), len(p.drafts), expected))
    assert num_compared > 0.9 * len(proposals) and not wrong, wrong[:5]


def test_confidence_is_the_heads_probability_of_its_draft_at_a_temperature():
    from types import SimpleNamespace

    from serving.drafters.confidence import Confidence, log_confidence, top_log_probs
    from serving.drafters.medusa import MedusaDrafter

    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.45, 0.35]]))
    log_probs, ids = top_log_probs(logits, 1, 1.0)
    assert ids[:, 0].tolist() == [0, 1]
    torch.testing.assert_close(log_probs[:, 0].exp(), torch.tensor([0.6, 0.45]))
    torch.testing.assert_close(log_confidence(logits, 1.0).exp(), torch.tensor([0.6, 0.45]))
    log_probs, ids = top_log_probs(logits, 2, 2.0)  # the two most likely, at temperature 2
    assert ids.tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(log_probs.exp(), (logits / 2).softmax(-1).topk(2).values)
    torch.testing.assert_close(log_confidence(logits, 2.0).exp(), (logits / 2).softmax(-1).amax(-1))
    # draft d reads the temperature its fit calibrated for it, 1 past them; no threshold cuts nothing
    head = SimpleNamespace(config=SimpleNamespace(confidence_temperatures=[1.7, 0.6]))
    confidence = Confidence(head, 0.0)
    assert [confidence.temperature(d) for d in (1, 2, 3)] == [1.7, 0.6, 1.0]
    assert confidence.log_threshold == -float("inf") and Confidence(head, 0.25).log_threshold == pytest.approx(-1.3862944)
    # the adaptive policy's price of a row cuts where it is above the config's threshold
    assert Confidence(head, 0.25).log_threshold_for(DraftBudget(4, 4, math.log(0.5))) == pytest.approx(math.log(0.5))
    assert Confidence(head, 0.25).log_threshold_for(DraftBudget(4, 4, math.log(0.1))) == pytest.approx(math.log(0.25))
    assert confidence.log_threshold_for(DraftBudget(4, 4)) == -float("inf")
    # a head over a token map drafts target ids
    drafter = MedusaDrafter.__new__(MedusaDrafter)
    drafter.token_map, drafter.num_ranks, drafter.confidence = torch.tensor([7, 8, 9]), 2, Confidence(head, 0.0)
    log_probs, ids = drafter._top(logits, 2)
    assert ids == [[7, 8], [8, 9]]
    torch.testing.assert_close(torch.tensor(log_probs).exp(), (logits / 0.6).softmax(-1).topk(2).values)


def test_mtp_chain_with_a_confidence_threshold_cuts_the_chain_where_its_probability_falls_below_it(
        tiny_llama, heads_root, monkeypatch):
    head = perturb(chain_mtp(tiny_llama, K), seed=13)
    head.config.confidence_temperatures = list(TEMPERATURES)
    head_dir = str(heads.save(head, heads_root / "mtp-chain-threshold"))
    threshold = median_confidence(tiny_llama, head_dir, "mtp", monkeypatch)
    prompts = random_prompts([5, 23, 9, 40], seed=46)
    engine = make_engine(tiny_llama, dict(spec_config("mtp", head_dir), confidence_threshold=threshold), num_blocks=64)
    proposals = record_proposals(engine)
    outputs = engine.generate(prompts, greedy(20))
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, prompts, 20)
    cut = [p for p in proposals if len(p.drafts) < p.budget]
    assert cut and len(cut) < len(proposals), f"{len(cut)} of {len(proposals)} proposals cut"
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    loaded = load_as_drafted(head_dir, tiny_llama)
    wrong, num_compared = [], 0
    for p in proposals:
        drafts, logits = dense_chain_drafts(loaded, hf_hidden_states(tiny_llama, finals[p.request_id]), p.token_ids,
                                            p.budget)
        expected = expected_cut(logits, threshold)
        num_compared += expected is not None
        if p.drafts != drafts[:len(p.drafts)] or expected not in (None, len(p.drafts)):
            wrong.append((p.request_id, len(p.token_ids), p.drafts, drafts, expected))
    assert num_compared > 0.9 * len(proposals) and not wrong, wrong[:5]


# ---- prompt lookup first: lookup drafts where the text repeats, the head elsewhere ------------------------


REPEATING = [p + p[:len(p) // 3 + 1] for p in PROMPTS]  # each prompt's first third again: the lookup finds it


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind, fixture", HEAD_CASES, ids=[f"{k}-{f}" for k, f in HEAD_CASES])
def test_lookup_first_drafts_repeats_by_lookup_and_the_rest_by_the_head(kind, fixture, concurrency, heads_root,
                                                                        request):
    """Where the lookup finds the last tokens earlier, the chain is its proposal; everywhere else it is the
    head's, equal to the dense reference although the head drafted nothing at the lookup's steps (its catch-up
    must still cover every kept token). Outputs stay plain greedy decoding's."""
    from serving.drafters.ngram import NgramDrafter

    folder = request.getfixturevalue(fixture)
    head_dir = random_head_dir(kind, folder, heads_root)
    engine = make_engine(folder, dict(spec_config(kind, head_dir), prompt_lookup_first=True), **SCENARIOS[concurrency])
    assert engine.speculator.config.prompt_lookup_min == 2
    proposals = record_proposals(engine)
    outputs = engine.generate(REPEATING, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_outputs(folder, REPEATING, MAX_TOKENS)
    assert_pool_idle(engine)
    lookup = NgramDrafter(engine.speculator.config)
    by_lookup = [p for p in proposals if lookup.lookup(p.token_ids, p.budget)]
    by_head = [p for p in proposals if not lookup.lookup(p.token_ids, p.budget)]
    assert len(by_lookup) >= 8 and len(by_head) >= 8, f"{len(by_lookup)} lookup and {len(by_head)} head proposals"
    assert all(p.drafts == lookup.lookup(p.token_ids, p.budget) for p in by_lookup)
    assert all(len(p.drafts) == p.budget for p in by_head)  # a head fills every budget it is given
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    num_checked, mismatches = check_against_dense(folder, load_as_drafted(head_dir, folder), by_head, finals)
    assert not mismatches, f"{len(mismatches)} of {num_checked} head proposals differ:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_heads_draft_right_once_the_batch_shrinks_to_disable_by_batch_size(kind, heads_root, request):
    """Drafting is off while more than 3 requests run; the pool still catches up every step, so once drafting
    resumes every proposal equals the dense reference."""
    folder = request.getfixturevalue("tiny_qwen3")
    head_dir = random_head_dir(kind, folder, heads_root)
    engine = make_engine(folder, dict(spec_config(kind, head_dir), disable_by_batch_size=3), max_num_seqs=8)
    proposals = record_proposals(engine)
    params = [SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outputs = engine.generate(PROMPTS, params)
    plain = [o.token_ids for o in make_engine(folder).generate(PROMPTS, params)]
    assert [o.token_ids for o in outputs] == plain
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    first_drafts = {p.request_id: len(p.token_ids) for p in reversed(proposals)}
    assert all(first_drafts[o.request_id] > len(o.prompt_token_ids) + 1 for o in outputs[-3:])  # started late
    num_checked, mismatches = check_against_dense(folder, load_as_drafted(head_dir, folder), proposals, finals)
    assert num_checked >= 20 and not mismatches, mismatches[:10]


EAGLE31 = {"norm_before_fc": dict(norm_before_fc=True, norm_output=True), "fc_norm": dict(fc_norm=True, norm_output=True)}


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("norms", EAGLE31)
def test_eagle31_heads_reproduce_plain_greedy_and_draft_as_the_dense_head(norms, concurrency, tiny_llama, heads_root):
    """EAGLE 3.1's norms (before fc, and the normed output fed back) in the engine: outputs stay plain greedy
    decoding's under chunked prefill and preemption, and every proposal equals the dense head's."""
    with torch.random.fork_rng():
        torch.manual_seed(11)
        head = heads.Eagle3.from_target(target_parts(tiny_llama), draft_token_ids=torch.randperm(VOCAB)[:VOCAB // 2],
                                        aux_layers=EAGLE3_AUX, **EAGLE31[norms])
    folder = heads.save(perturb(head, seed=12), heads_root / f"eagle31-{norms}")
    engine = make_engine(tiny_llama, spec_config("eagle3", folder), **SCENARIOS[concurrency])
    proposals = record_proposals(engine)
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, PROMPTS, MAX_TOKENS)
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    num_checked, mismatches = check_against_dense(tiny_llama, load_as_drafted(folder, tiny_llama), proposals, finals)
    assert num_checked >= 8 * 4
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])


DRAFT_WINDOW = 5  # keys a draft row sees: far fewer than the 3-74 tokens of the requests


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_heads_with_a_draft_window_reproduce_plain_greedy_and_draft_as_the_dense_windowed_head(
        kind, concurrency, tiny_llama, heads_root):
    """draft_window 5: the drafter's pooled K/V attend within the window (catch-up, drafts; chains and trees), every
    proposal equals the dense head's under an explicit window mask and differs somewhere from the same head drafting
    over the whole context, and greedy outputs stay plain decoding's under chunked prefill and preemption."""
    head = perturb(new_head(kind, target_parts(tiny_llama), seed=11, draft_window=DRAFT_WINDOW), seed=12)
    folder = heads.save(head, heads_root / f"{kind}-window-{concurrency}")
    expected = plain_outputs(tiny_llama, PROMPTS, MAX_TOKENS)
    tree_engine = make_engine(tiny_llama, dict(spec_config(kind, folder), topk=2), **SCENARIOS[concurrency])
    assert [o.token_ids for o in tree_engine.generate(PROMPTS, greedy(MAX_TOKENS))] == expected
    engine = make_engine(tiny_llama, spec_config(kind, folder), **SCENARIOS[concurrency])
    proposals = record_proposals(engine)
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert_pool_idle(engine)
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    windowed = load_as_drafted(folder, tiny_llama)
    num_checked, mismatches = check_against_dense(tiny_llama, windowed, proposals, finals)
    assert num_checked >= 8 * 4
    assert not mismatches, f"{len(mismatches)} of {num_checked} proposals differ:\n" + "\n".join(mismatches[:10])
    windowed.config.draft_window = 0
    assert check_against_dense(tiny_llama, windowed, proposals, finals)[1], "the window changed no draft"
