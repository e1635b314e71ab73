"""The token loss of a draft position, one definition for every head kind: cross-entropy against the hard label, KL
to the target's distribution, total variation, the LK hybrid of the two (Samarin et al. 2026, "LK Losses: Direct
Acceptance Rate Optimization for Speculative Decoding", arXiv 2602.23881), or a weighted mix of them.

Per row, with q = softmax(logits) the head's distribution over the rows it drafts from, p = exp(target_logprobs) the
target's over the same rows, and y the label's row:

    ce         -log q_y
    kl         KL(p || q) = sum_v p_v (log p_v - log q_v)
    tv         TV(p, q) = 1/2 sum_v |p_v - q_v| = 1 - alpha,   alpha = sum_v min(p_v, q_v)
    lk_hybrid  lambda * KL(p || q) + (1 - lambda) * TV(p, q),   lambda = exp(-eta * sg[alpha])

alpha is the probability that the target accepts a token drafted from q (speculative sampling's acceptance rate at
that position), so tv trains acceptance itself; its gradient vanishes where p and q barely overlap, which is where
KL's does not. lk_hybrid leans on KL while alpha is low and moves to TV as it grows; alpha in lambda is detached (sg,
stop-gradient) and taken per row, as speculators' `lk_hybrid` does, with eta = 3 the paper's best setting. A mix
{name: weight} is the weighted sum of its terms, e.g. {"kl": 0.5, "tv": 0.5}. At greedy decoding what counts is
that argmax q is argmax p; every loss here has that at its optimum.

A module calls the loss once per draft position with that position's rows and applies its own per-position weight
(decay^s, loss_weights[i], ...) and averaging: the weighting stays explicit in each module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("ce", "kl", "tv", "lk_hybrid")
NEEDS_TARGET = ("kl", "tv", "lk_hybrid")  # the losses that read the target's distribution

LossSpec = str | dict[str, float]


@dataclass(frozen=True)
class DraftLoss:
    """weights: {loss name: weight}; lk_eta: eta of lk_hybrid's lambda."""

    weights: dict[str, float]
    lk_eta: float = 3.0

    @classmethod
    def parse(cls, loss: LossSpec, lk_eta: float = 3.0) -> "DraftLoss":
        """A name of LOSSES, or a mix {name: weight} of them with non-negative weights, not all zero."""
        weights = {loss: 1.0} if isinstance(loss, str) else dict(loss)
        unknown = [name for name in weights if name not in LOSSES]
        if unknown or not weights:
            raise ValueError(f"loss={loss!r}: choose one of {', '.join(LOSSES)}, or a mix of them such as "
                             '{"kl": 0.5, "tv": 0.5}')
        if any(not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 for w in weights.values()) \
                or not any(weights.values()):
            raise ValueError(f"loss={loss!r}: a mix's weights must be non-negative numbers, not all zero")
        if lk_eta < 0:
            raise ValueError(f"lk_eta={lk_eta} must be >= 0 (0 makes lk_hybrid plain KL)")
        return cls({name: float(w) for name, w in weights.items() if w}, float(lk_eta))

    @property
    def needs_target(self) -> bool:
        """Whether a call needs target_logprobs (every loss but ce)."""
        return any(name in NEEDS_TARGET for name in self.weights)

    @property
    def needs_labels(self) -> bool:
        return "ce" in self.weights

    def __call__(self, logits: torch.Tensor, target_logprobs: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None) -> torch.Tensor:
        """Per-row loss [N] of one draft position.

        Args:
            logits: [N, V] the head's logits over the V rows it drafts from.
            target_logprobs: [N, V] the target's log-probabilities over the same rows (renormalised over them),
                no gradient; needed by every loss but ce.
            labels: [N] the row of each row's label, -1 where the label is none of the V rows (its ce term is 0,
                the head cannot draft it); needed by ce.
        """
        if self.needs_target and target_logprobs is None:
            raise ValueError(f"loss {self.weights} reads the target's distribution, but no target_logprobs were given")
        if self.needs_labels and labels is None:
            raise ValueError(f"loss {self.weights} reads the labels, but no labels were given")
        logprobs = logits.float().log_softmax(-1)
        total = logprobs.new_zeros(logprobs.shape[0])
        if self.needs_target:
            target_logprobs = target_logprobs.float()
            p, q = target_logprobs.exp(), logprobs.exp()
            kl = torch.where(p > 0, p * (target_logprobs - logprobs), 0.0).sum(-1)  # 0 log 0 = 0
            alpha = torch.minimum(p, q).sum(-1)
            tv = 0.5 * (p - q).abs().sum(-1)
            lam = torch.exp(-self.lk_eta * alpha.detach())
            terms = {"kl": kl, "tv": tv, "lk_hybrid": lam * kl + (1 - lam) * tv}
        else:
            terms = {}
        if self.needs_labels:
            inside = labels >= 0
            terms["ce"] = F.nll_loss(logprobs, labels.clamp(min=0), reduction="none") * inside
        for name, weight in self.weights.items():
            total = total + weight * terms[name]
        return total

