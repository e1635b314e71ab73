"""P-EAGLE (Hui et al. 2026, "P-EAGLE: Parallel-Drafting EAGLE with Scalable Training", arXiv 2602.01469).

An EAGLE-3 head (heads/eagle3.py: `fc` over the aux layers, input and hidden norms, one decoder layer, its own
`norm` and draft-vocabulary `lm_head`, d2t/t2d) that drafts a whole block in one forward. At anchor t, depth 0 is
EAGLE-3's usual input, (x_{t+1}, fc(aux_t)) at position t, and predicts x_{t+2}; depth d = 1..K-1 takes the embedding
of `mask_token_id` and fc(`mask_hidden`), one learnable vector in the place of the aux layers' states shared by every
depth, at position t + d, and predicts x_{t+d+2}. Each element attends to the depth-0 elements at anchors <= its own
(the real context) and to the elements of its own rollout at depths <= its own (`block_mask`), so all K drafts come
out of one forward over the context and K - 1 placeholder rows.

`mask_hidden` is kept before `fc` (num_aux * hidden wide), as speculators trains it and vLLM loads it (its parallel
drafting passes it through the same fc); `num_depths` is the K the head was trained for.

With `markov_rank` r > 0, a low-rank Markov head (DSpark, arXiv 2607.05147) adds to the logits of depths 1..K-1 a bias
from the token before: markov_out(markov_in[x]), x the draft (the label, in training) of the depth before. The
placeholder rows cannot see the drafts before them; this brings back their one-token dependency at the cost of an r x
draft-vocabulary product per depth, drafted left to right after the one forward. `markov_in` has a row per draft
token and one more for every token outside the draft vocabulary; `markov_out` starts at zero (the head starts as
plain P-EAGLE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads.attention import in_window
from heads.eagle3 import Eagle3, Eagle3Config


@dataclass
class PeagleConfig(Eagle3Config):
    kind = "peagle"

    mask_token_id: int | None = None  # the token whose embedding every placeholder row (depth >= 1) reads
    num_depths: int = 4  # K: depth 0 and K - 1 placeholder depths, trained together; drafts K tokens per forward
    markov_rank: int = 0  # r of the Markov head's bias on depths >= 1 from the token before; 0: none (module docstring)

    def __post_init__(self):
        super().__post_init__()
        token = self.mask_token_id
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise ValueError(f"mask_token_id={token!r} must be a token id of the target's vocabulary [0, "
                             f"{self.vocab_size}): set mask_token_id to the token whose embedding the placeholder rows "
                             "read (any fixed id; one the answers rarely use, e.g. a special token)")
        depths = self.num_depths
        if isinstance(depths, bool) or not isinstance(depths, int) or depths < 2:
            raise ValueError(f"num_depths={depths!r} must be an integer >= 2 (depth 0 and at least one placeholder "
                             "depth): a P-EAGLE head drafts num_depths tokens per forward")
        rank = self.markov_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"markov_rank={rank!r} must be an integer >= 0 (0: no Markov head)")


class Peagle(Eagle3):
    config_class = PeagleConfig

    def __init__(self, config: PeagleConfig):
        super().__init__(config)
        # [1, 1, num_aux * hidden]: speculators' shape (vLLM reads it flat)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(config.aux_layers) * config.hidden_size))
        if config.markov_rank:
            self.markov_in = nn.Embedding(config.draft_vocab_size + 1, config.markov_rank)
            self.markov_out = nn.Linear(config.markov_rank, config.draft_vocab_size, bias=False)
            nn.init.zeros_(self.markov_out.weight)

    def mask_feature(self) -> torch.Tensor:
        """fc(mask_hidden): [hidden], the g of every placeholder row."""
        return self.fuse(self.mask_hidden[0])[0]

    def markov_rows(self, previous: torch.Tensor) -> torch.Tensor:
        """previous: [...] target ids -> their rows of markov_in: the draft id, or draft_vocab_size outside it."""
        return torch.where(self.t2d[previous], self.draft_index[previous], self.config.draft_vocab_size)

    def markov_bias(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [...] markov_in rows of the tokens before (a draft's draft id is its row) -> [..., draft_vocab] the
        Markov head's bias on the next depth's logits (markov_rank > 0)."""
        return self.markov_out(self.markov_in(rows))

    def depth_logits(self, out: torch.Tensor, depth: int, previous: torch.Tensor | None) -> torch.Tensor:
        """The logits of depth `depth` (0-based) from its rows `out` [..., hidden]; previous: [...] the tokens of the
        depth before (target ids), read by the Markov head at depths >= 1."""
        logits = self.logits(out)
        if not self.config.markov_rank or not depth:
            return logits
        return logits + self.markov_bias(self.markov_rows(previous)).to(logits.dtype)


def block_mask(anchors: torch.Tensor, depths: torch.Tensor, is_real: torch.Tensor, window: int = 0) -> torch.Tensor:
    """anchors, depths: [..., N] each element's anchor t and depth d (position t + d); is_real: [..., N] False for
    padding. -> [..., N, N] bool, True where query element i attends to key element j: j at depth 0 with anchor <= i's,
    or j in i's rollout (same anchor) at a depth <= i's; with a `window` (the head's draft_window), only keys in i's
    sliding window (heads.attention.in_window, by position). Padding keys are never seen; a row that sees nothing sees
    key 0, so that its softmax stays finite."""
    a_q, a_k = anchors[..., :, None], anchors[..., None, :]
    d_q, d_k = depths[..., :, None], depths[..., None, :]
    mask = ((d_k == 0) & (a_k <= a_q)) | ((a_k == a_q) & (d_k <= d_q))
    mask &= is_real[..., None, :]
    if window:
        mask &= in_window(anchors + depths, anchors + depths, window)
    mask[..., 0] |= ~mask.any(-1)
    return mask
