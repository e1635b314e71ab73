"""DSpark: DFlash's block drafter (heads/dflash.py) plus a low-rank Markov head and a confidence head, as speculators'
`dspark` and vLLM's Qwen3 DSpark model define them.

The backbone is DFlash's unchanged: one forward over the block `[x_a, MASK x (B-1)]` at positions a..a+B-1, the
context entering as K/V of every layer. What a slot predicts depends on `sample_from_anchor`:

- true (speculators' and vLLM's default, "anchor as first prediction"): slot k predicts x_{a+k+1}, the next token as
  in a causal LM, so a block drafts B tokens, the anchor's slot the first;
- false (DFlash's fill-in layout): slot k >= 1 predicts x_{a+k}, B - 1 drafts, the anchor's slot unused.

Either way draft j (of x_{a+j}, j = 1, 2, ...) reads slot `draft_slot(j)`, and its logits are the backbone's plus a
bias that depends on the token before it, x_{a+j-1} (the anchor for j = 1, draft j - 1 after):

    logits_j = lm_head(norm(out_slot)) + W2 @ W1[x_{a+j-1}]

W1 (`markov_w1`, an embedding over the target's vocabulary, [vocab, rank]) and W2 (`markov_w2`, [draft rows, rank],
no bias) factor a first-order transition bias of rank `markov_rank` (256 by default). The backbone runs once; the
bias makes the drafts a left-to-right chain that costs one embedding row and one rank x vocab product per draft.
Training conditions it on the true previous tokens (teacher forcing), serving on the drafted ones.

The confidence head is one linear layer with a bias to one logit: sigmoid(proj([norm(out_slot), W1[x_{a+j-1}]])) (the
Markov embedding only with `confidence_with_markov`) estimates the probability that the target accepts draft j, trained
against 1 - TV(target, draft) (speculators' target, training/modules/dspark.py). vLLM uses it to size verification
(`enable_adaptive_verification`); our engine's adaptive policy reads it as a draft's survival (serving/drafters/dspark.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads.dflash import DFlash, DFlashConfig


@dataclass
class DSparkConfig(DFlashConfig):
    kind = "dspark"

    markov_rank: int = 256  # rank of the transition bias W2 @ W1[previous token]
    sample_from_anchor: bool = True  # slot k predicts x_{a+k+1} (B drafts); false: DFlash's slot k -> x_{a+k}
    confidence_head: bool = True  # the per-draft acceptance estimate
    confidence_with_markov: bool = True  # the confidence head also reads the previous token's Markov embedding

    def __post_init__(self):
        super().__post_init__()
        rank = self.markov_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"markov_rank={rank!r} must be a positive integer (speculators' default is 256)")
        for name in ("sample_from_anchor", "confidence_head", "confidence_with_markov"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.causal:
            raise ValueError("causal=true: DSpark's blocks attend bidirectionally (vLLM serves no causal DSpark); "
                             "set causal: false")

    @property
    def num_drafts(self) -> int:
        """Drafts one block makes: B when the anchor's slot predicts, B - 1 (DFlash's) otherwise."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def draft_slot(self, j: int) -> int:
        """The block slot whose output drafts x_{a+j} (j >= 1)."""
        return j - 1 if self.sample_from_anchor else j


class DSpark(DFlash):
    config_class = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        c = config
        rows = c.token_map_size or c.vocab_size
        self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, rows, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' init: a small bias at the start
        self.confidence = (nn.Linear(c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0), 1)
                           if c.confidence_head else None)

    @property
    def draft_slots(self) -> slice:
        """The slots of a block that draft, in draft order."""
        first = self.config.draft_slot(1)
        return slice(first, first + self.config.num_drafts)

    def markov_embed(self, previous: torch.Tensor) -> torch.Tensor:
        """previous: [...] target ids of the tokens before the drafted ones -> [..., rank]."""
        return self.markov_w1(previous)

    def markov_logits(self, out: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """out: [..., hidden] a draft slot's output (before the final norm); embed: [..., rank] the previous token's
        Markov embedding -> [..., rows] the draft's logits, backbone plus transition bias."""
        return self.logits(out) + self.markov_w2(embed)

    def confidence_logit(self, out: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """out, embed as markov_logits' -> [...] the logit of the probability that the target accepts the draft."""
        features = self.norm(out)
        if self.config.confidence_with_markov:
            features = torch.cat([features, embed.to(features.dtype)], dim=-1)
        return self.confidence(features).squeeze(-1)

    @torch.no_grad()
    def warm_start(self, dflash: DFlash) -> "DSpark":
        """Copies a trained DFlash head's tensors (fusion, layers, norms) into this one: the Markov and confidence
        heads start fresh, as speculators starts a dspark run from a dflash checkpoint. The two must agree on
        everything DFlash's config fixes but the kind; with sample_from_anchor the slots' targets move one token
        later than DFlash trained them for, which training then has to relearn."""
        ours, theirs = self.config.to_dict(), dflash.config.to_dict()
        differing = [key for key in theirs if key not in ("kind", "metadata", "confidence_temperatures")
                     and ours.get(key) != theirs[key]]
        if differing:
            raise ValueError("the DFlash head differs from this DSpark head in "
                             + ", ".join(f"{key} ({theirs[key]!r} vs {ours[key]!r})" for key in differing)
                             + ": make the DSpark head with the DFlash head's settings")
        if dflash.token_map is not None and not torch.equal(dflash.token_map.cpu(), self.token_map.cpu()):
            raise ValueError("the DFlash head drafts over another token map than this DSpark head: make the DSpark head "
                             "with the DFlash head's token map")
        own = self.state_dict()
        for name, tensor in dflash.state_dict().items():
            own[name].copy_(tensor)
        return self
