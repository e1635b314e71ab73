"""DSpark's Markov step (serving/drafters/markov.py) against the full product over all of W2: the same children and
logits whether it reads only the rows of the backbone's shortlist or, where the bias could reach past it, all of
them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from serving import kernels
from serving.drafters import markov
from serving.drafters.markov import MarkovStep

ROWS, RANK, VOCAB = 4096, 64, 5000


def packed_w2(weight: torch.Tensor, weight_dtype=torch.float32) -> kernels.PackedLinear:
    linear = nn.Linear(RANK, ROWS, bias=False).requires_grad_(False)
    linear.weight.copy_(weight)
    return kernels.PackedLinear(linear, weight_dtype)


def markov_w1(weight: torch.Tensor) -> nn.Embedding:
    return nn.Embedding.from_pretrained(weight)


def counting(packed: kernels.PackedLinear) -> list:
    """Counts the rows of the full products `packed` computes."""
    calls, forward = [], packed.forward
    packed.forward = lambda x: calls.append(len(x)) or forward(x)
    return calls


def step_top(step, base, previous, w1, num):
    """The step over the first (only) slot of len(base) requests, one node each."""
    slots = base[:, None]
    return step.top(slots, torch.arange(len(base)), 0, step.shortlist(slots, num), previous, w1(previous), num)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num", [1, 4])
@pytest.mark.parametrize("scale, gathers", [(0.05, True), (0.5, True), (30.0, False)],
                         ids=["small-bias", "moderate-bias", "bias-beyond-the-logits"])
@pytest.mark.parametrize("exact_reach", [True, False], ids=["largest-bias", "norm-bound"])
def test_the_step_takes_the_full_products_top_children(weight_dtype, num, scale, gathers, exact_reach, monkeypatch):
    """Backbone logits spread as a drafter's (std 3), Markov embeddings of norm `scale`: a small bias cannot lift a
    token from beyond the shortlist and the step reads the shortlist's rows only; a bias beyond the logits could,
    and the step computes the full product. Either way its children and logits are the full product's, with the
    largest bias after each token computed exactly or bounded by norms (a W2 of more rows)."""
    if not exact_reach:
        monkeypatch.setattr(markov, "EXACT_REACH_ROWS", 0)
    g = torch.Generator().manual_seed(int(scale * 100) + num)
    packed = packed_w2(torch.randn(ROWS, RANK, generator=g) / RANK ** 0.5, weight_dtype)
    embeddings = torch.randn(VOCAB, RANK, generator=g)
    w1 = markov_w1(scale * embeddings / embeddings.norm(dim=-1, keepdim=True))
    step, calls = MarkovStep(w1, packed), counting(packed)
    for nodes in (1, 3):
        base = 3 * torch.randn(nodes, ROWS, generator=g)
        previous = torch.randint(VOCAB, (nodes,), generator=g)
        expected_values, expected_tokens = (base + packed(w1(previous))).topk(num, dim=-1)
        calls.clear()
        values, tokens = step_top(step, base, previous, w1, num)
        assert (not calls) == gathers
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(values, expected_values)


@pytest.mark.parametrize("place, gathers", [(8, True), (500, False)], ids=["in-the-shortlist", "beyond-it"])
def test_a_token_the_bias_lifts_from_far_down_wins(place, gathers):
    """One token's bias aligned with the embedding lifts it from the backbone's `place`-th logit to the first (its
    bias exactly |W2[t]| |e|); every other bias nearly zero. From within the shortlist the step finds it among the
    shortlist's rows; from beyond it the bound cannot rule it out, and the full product finds it."""
    g = torch.Generator().manual_seed(3)
    w2 = 1e-3 * torch.randn(ROWS, RANK, generator=g)
    base = 3 * torch.randn(1, ROWS, generator=g)
    order = base[0].argsort(descending=True)
    best, lifted = order[0], order[place]
    w2[lifted] = torch.randn(RANK, generator=g)
    embeddings = 1e-3 * torch.randn(VOCAB, RANK, generator=g)
    previous = torch.tensor([17])
    embeddings[previous] = w2[lifted] / w2[lifted].norm()  # |e| = 1, aligned: the bias of `lifted` is |W2[lifted]|
    w2[lifted] *= (float(base[0, best] - base[0, lifted]) + 0.5) / w2[lifted].norm()
    packed, w1 = packed_w2(w2), markov_w1(embeddings)
    expected_values, expected_tokens = (base + packed(w1(previous))).topk(2, dim=-1)
    step, calls = MarkovStep(w1, packed), counting(packed)
    values, tokens = step_top(step, base, previous, w1, 2)
    assert tokens.tolist() == expected_tokens.tolist() and tokens[0, 0] == lifted
    torch.testing.assert_close(values, expected_values)
    assert (not calls) == gathers


def test_a_vocabulary_within_the_shortlist_needs_no_bound():
    """Rows fewer than the shortlist: every token is listed, whatever the bias, and the step never takes the full
    product."""
    g = torch.Generator().manual_seed(5)
    rows = 24
    linear = nn.Linear(RANK, rows, bias=False).requires_grad_(False)
    linear.weight.copy_(10 * torch.randn(rows, RANK, generator=g))
    packed, w1 = kernels.PackedLinear(linear), markov_w1(torch.randn(VOCAB, RANK, generator=g))
    base, previous = torch.randn(2, rows, generator=g), torch.tensor([3, 9])
    step, calls = MarkovStep(w1, packed), counting(packed)
    values, tokens = step_top(step, base, previous, w1, 3)
    expected_values, expected_tokens = (base + linear(w1(previous))).topk(3, dim=-1)
    assert torch.equal(tokens, expected_tokens) and not calls
    torch.testing.assert_close(values, expected_values)


def test_the_table_holds_every_previous_tokens_children_where_it_says_so():
    """table() gives, for every slot and every listed previous token, the full product's top children, and flags
    just the ones it cannot vouch for: with a small bias none, with a bias beyond the logits some; wherever unflagged
    they equal the full product's."""
    g = torch.Generator().manual_seed(8)
    packed = packed_w2(torch.randn(ROWS, RANK, generator=g) / RANK ** 0.5)
    embeddings = torch.randn(VOCAB, RANK, generator=g)
    for scale, any_missed in ((0.3, False), (30.0, True)):
        w1 = markov_w1(scale * embeddings / embeddings.norm(dim=-1, keepdim=True))
        step = MarkovStep(w1, packed)
        base = 3 * torch.randn(2, 3, ROWS, generator=g)  # 2 requests, 3 slots
        previous = torch.randint(VOCAB, (2, 3, 5), generator=g)  # 5 previous tokens per slot
        values, rows, missed = step.table(base, step.shortlist(base, 2), previous, w1(previous), 2)
        assert values.shape == rows.shape == (2, 3, 5, 2) and missed.shape == (2, 3, 5)
        assert bool(missed.any()) == any_missed
        full = (base[:, :, None] + packed(w1(previous))).topk(2, dim=-1)
        held = ~missed
        assert torch.equal(rows[held], full.indices[held])
        torch.testing.assert_close(values[held], full.values[held])
