"""The token losses (training/modules/losses.py) against their formulas on small tensors, and every head kind handing
each loss the target's distribution of the very token its draft position predicts."""
from __future__ import annotations

import math

import pytest
import torch

from training.data.datamodule import DraftDataModule
from training.data.store import Store
from training.modules import MODULES
from training.modules.losses import LOSSES, DraftLoss

SMALL = {"medusa": {"num_heads": 2, "num_speculative_tokens": 2}, "eagle": {"num_unroll_steps": 2},
         "eagle3": {"num_steps": 2, "draft_vocab_size": 1024}, "mtp": {}, "peagle": {"draft_vocab_size": 1024},
         "dflash": {"block_size": 5, "mask_token_id": 16, "num_anchors": 8},
         "dspark": {"block_size": 4, "mask_token_id": 16, "num_anchors": 8, "markov_rank": 8}}


def distributions():
    """(logits [2, 3], target log-probs [2, 3], p, q) with hand-checkable rows."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5]])
    return q.log(), p.log(), p, q


def test_each_loss_is_its_formula():
    logits, target_logprobs, p, q = distributions()
    labels = torch.tensor([1, -1])
    losses = {name: DraftLoss.parse(name)(logits, target_logprobs, labels) for name in LOSSES}
    # ce: -log q_y, and 0 where the label is none of the rows
    torch.testing.assert_close(losses["ce"], torch.tensor([-math.log(0.25), 0.0]))
    # kl: sum_v p_v log(p_v / q_v), p_v = 0 terms 0
    torch.testing.assert_close(losses["kl"], torch.tensor([2 * 0.5 * math.log(0.5 / 0.25), 0.0]))
    # tv: 1/2 sum |p - q| = 1 - sum min(p, q)
    torch.testing.assert_close(losses["tv"], torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(losses["tv"], 1 - torch.minimum(p, q).sum(-1))
    # lk_hybrid: lambda KL + (1 - lambda) TV with lambda = exp(-3 alpha), alpha = 1 - TV
    lam = torch.exp(-3.0 * torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(losses["lk_hybrid"], lam * losses["kl"] + (1 - lam) * losses["tv"])


def test_kl_and_tv_on_random_rows_match_a_direct_sum():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    target_logprobs = torch.randn(5, 7, generator=generator, dtype=torch.float64).log_softmax(-1)
    p, q = target_logprobs.exp(), logits.softmax(-1)
    for n in range(5):
        kl = sum(p[n, v] * math.log(p[n, v] / q[n, v]) for v in range(7))
        tv = 0.5 * sum(abs(p[n, v] - q[n, v]) for v in range(7))
        assert math.isclose(DraftLoss.parse("kl")(logits, target_logprobs)[n].item(), kl, rel_tol=1e-5)
        assert math.isclose(DraftLoss.parse("tv")(logits, target_logprobs)[n].item(), tv, rel_tol=1e-5)


def test_lk_hybrid_weights_kl_by_a_detached_acceptance_rate():
    """lambda = exp(-eta alpha) is a constant to the gradient: the gradient is lambda grad KL + (1 - lambda) grad TV.
    eta = 0 is KL; a large eta is TV."""
    generator = torch.Generator().manual_seed(1)
    target_logprobs = torch.randn(4, 6, generator=generator).log_softmax(-1)
    logits = torch.randn(4, 6, generator=generator, requires_grad=True)
    DraftLoss.parse("lk_hybrid", lk_eta=2.0)(logits, target_logprobs).sum().backward()
    hybrid_grad = logits.grad.clone()
    alpha = torch.minimum(target_logprobs.exp(), logits.detach().softmax(-1)).sum(-1)
    lam = torch.exp(-2.0 * alpha)
    logits.grad = None
    kl = DraftLoss.parse("kl")(logits, target_logprobs)
    tv = DraftLoss.parse("tv")(logits, target_logprobs)
    (lam * kl + (1 - lam) * tv).sum().backward()
    torch.testing.assert_close(hybrid_grad, logits.grad)
    with torch.no_grad():
        torch.testing.assert_close(DraftLoss.parse("lk_hybrid", lk_eta=0.0)(logits, target_logprobs), kl)
        torch.testing.assert_close(DraftLoss.parse("lk_hybrid", lk_eta=1e4)(logits, target_logprobs), tv)


def test_a_mix_is_the_weighted_sum_of_its_terms():
    logits, target_logprobs, _, _ = distributions()
    labels = torch.tensor([0, 2])
    terms = {name: DraftLoss.parse(name)(logits, target_logprobs, labels) for name in LOSSES}
    mix = DraftLoss.parse({"kl": 0.5, "tv": 0.25, "ce": 1.0})(logits, target_logprobs, labels)
    torch.testing.assert_close(mix, 0.5 * terms["kl"] + 0.25 * terms["tv"] + terms["ce"])


def test_bad_losses_are_clear_errors():
    logits, target_logprobs, _, _ = distributions()
    with pytest.raises(ValueError, match="choose one of ce, kl, tv, lk_hybrid"):
        DraftLoss.parse("js")
    with pytest.raises(ValueError, match="non-negative"):
        DraftLoss.parse({"kl": -1.0})
    with pytest.raises(ValueError, match="not all zero"):
        DraftLoss.parse({"kl": 0.0})
    with pytest.raises(ValueError, match="lk_eta"):
        DraftLoss.parse("lk_hybrid", lk_eta=-1)
    with pytest.raises(ValueError, match="no target_logprobs"):
        DraftLoss.parse("tv")(logits)
    with pytest.raises(ValueError, match="no labels"):
        DraftLoss.parse("ce")(logits, target_logprobs)
    assert not DraftLoss.parse("ce").needs_target and DraftLoss.parse({"ce": 1, "tv": 1}).needs_target
    with pytest.raises(ValueError, match="choose one of"):
        MODULES["medusa"](target="debug", loss="bogus")


def test_each_kind_defaults_to_its_papers_loss():
    assert {kind: MODULES[kind](target="debug", **SMALL[kind]).draft_loss.weights for kind in MODULES} == {
        "medusa": {"ce": 1.0}, "eagle": {"kl": 1.0}, "eagle3": {"kl": 1.0}, "mtp": {"ce": 1.0}, "peagle": {"kl": 1.0},
        "dflash": {"ce": 1.0}, "dspark": {"ce": 1.0}}


class Recorder:
    """Wraps a module's DraftLoss and keeps what each call was given."""

    def __init__(self, loss: DraftLoss):
        self.loss, self.calls = loss, []
        self.needs_target, self.needs_labels = loss.needs_target, loss.needs_labels

    def __call__(self, logits, target_logprobs=None, labels=None):
        self.calls.append((target_logprobs, labels))
        return self.loss(logits, target_logprobs, labels)


def batch_of(store):
    data = DraftDataModule(str(store), target="debug", batch_size=4, heldout_fraction=0.3)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


@pytest.mark.parametrize("kind", list(MODULES))
def test_every_kind_gives_the_loss_the_targets_distribution_of_the_token_it_predicts(kind, debug_store):
    """On a store of the target's greedy answers, at every row a draft position is trained on, the target's most
    likely token is the row's label (up to the store's bfloat16 rounding of hidden states): the distribution is
    that of the token predicted, not of a neighbour."""
    module = MODULES[kind](target="debug", loss={"kl": 1.0, "ce": 1.0}, **SMALL[kind])
    module.use_store(Store(debug_store))
    module.draft_loss = Recorder(module.draft_loss)
    batch = batch_of(debug_store)
    module.training_loss(batch, module.hidden_states(batch))
    agree = total = 0
    for target_logprobs, labels in module.draft_loss.calls:
        inside = labels >= 0
        agree += int((target_logprobs.argmax(-1) == labels)[inside].sum())
        total += int(inside.sum())
    assert total > 50 and agree / total > 0.9


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("loss", [*LOSSES, {"kl": 0.5, "tv": 0.5}], ids=str)
def test_every_kind_trains_with_every_loss(kind, loss, debug_store):
    """A loss step is finite and reaches the head's weights."""
    module = MODULES[kind](target="debug", loss=loss, **SMALL[kind])
    module.use_store(Store(debug_store))
    batch = batch_of(debug_store)
    value, _ = module.training_loss(batch, module.hidden_states(batch))
    assert torch.isfinite(value) and value > 0
    value.backward()
    assert any(param.grad is not None and param.grad.abs().sum() > 0 for param in module.head.parameters())
