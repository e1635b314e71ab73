"""DSpark's Markov step (heads/dspark.py) for the drafter: the `num` largest logits of each node's children,
base + W2 @ W1[node's token], exactly, from a few rows of W2 rather than from all of it.

The full step reads all of `markov_w2` per depth (rows x rank: over the default target's vocabulary 25 MB of
bfloat16, more than the block's forward). Instead, once per step, each draft slot's backbone logits give a shortlist:
their `SHORTLIST` largest tokens and the largest base logit below them. By Cauchy-Schwarz the bias of a token is at
most |W2[v]| |e| away from zero, e the node's Markov embedding, so no token off the shortlist has a logit above (the
largest base logit below it) + the largest bias after the node's token (computed once per token for a head with a
token map; max_v |W2[v]| |e| otherwise). Where the shortlist's `num`-th largest exact logit (from its rows
of W2 alone) beats that bound, the shortlist holds the full product's top `num`; where it does not (a bias as large
as the gaps between the backbone's logits), only the full product over W2 finds them. Either way the step returns
the full product's `num` best (up to float rounding in the order of the sums), unlike vLLM's `dspark_draft_topk`,
which biases only the backbone's top k and can change the draft.

A node's token is, but where the bias lifted it from beyond, on its own slot's shortlist, so `table` computes the
children of every token of slot d's shortlist at slot d + 1 in one batched product per step (SHORTLIST x SHORTLIST
logits per slot) and the search reads them without a tensor operation per depth; `top` computes them for the nodes
the table does not hold.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from serving.kernels import PackedLinear

# Tokens per draft slot whose rows of W2 the step reads: the backbone's most likely. 32 keeps a step's gathers and
# products over 4 slots small enough for one thread (torch splits larger ones across threads, which a busy core
# stalls).
SHORTLIST = 32
# W2 rows up to which the largest bias after each previous token is computed exactly, once (a token map's 4,096: a
# 49,152 x 4,096 product), rather than bounded by norms.
EXACT_REACH_ROWS = 8192
REACH_CHUNK = 2048  # previous tokens per product while it is made (bounds its scratch memory)
# Slack of the bound, far above float32 rounding at logits' magnitudes (ulp 4e-6 at 32).
ROUNDING = 1e-3
# Draft rows up to which the drafter holds the bias after every draft token (`Transitions`; 4,096 rows: 64 MB of
# float32). Past it the table would outgrow the head, and the shortlist bounds the product instead.
TRANSITION_ROWS = 4096


class Transitions:
    """The Markov bias after every draft token, made once, for a head with a token map of at most TRANSITION_ROWS
    rows: bias[i] = W2 @ W1[token_map[i]]. A node past depth 0 holds a draft token, and the newest token at depth 0
    mostly does too (the map holds the most frequent tokens), so a node's children's logits are its slot's backbone
    logits plus one row of this table, a gather instead of a product over all of W2; only a newest token outside the
    map takes the product."""

    def __init__(self, markov_w1: torch.nn.Embedding, markov_w2: PackedLinear, token_map: torch.Tensor):
        self.bias = markov_w1(token_map).float() @ markov_w2.matrix().float().T  # [rows, rows]
        self.row_of = torch.full((markov_w1.num_embeddings,), -1, dtype=torch.long, device=token_map.device)
        self.row_of[token_map] = torch.arange(len(token_map), device=token_map.device)

    def after(self, previous: torch.Tensor) -> torch.Tensor | None:
        """previous: [N] target ids -> [N, rows] the bias each gives the next draft's logits, or None where one of them
        lies outside the map."""
        rows = self.row_of[previous]
        return self.bias.index_select(0, rows) if bool((rows >= 0).all()) else None


class Shortlist(NamedTuple):
    """Per draft slot [...]: its backbone's best logits, then the largest base logit below them [..., listed + 1]; the
    rows of the listed ones [..., listed]."""
    values: torch.Tensor
    rows: torch.Tensor


class MarkovStep:
    def __init__(self, markov_w1: torch.nn.Embedding, markov_w2: PackedLinear):
        self.markov_w2 = markov_w2
        # [rows, rank]: the stored weights row-major in float32, for gathers of a few rows (their bfloat16 values
        # widened once, not at every step)
        self.w2 = markov_w2.matrix().float()
        # For every previous token t, at least the largest bias any token gets after t, with the slack of rounding:
        # exactly max_v W2[v] . W1[t] where W2 has few rows (a token-mapped head: a product over the vocabulary once,
        # here), else max_v |W2[v]| |W1[t]| (Cauchy-Schwarz), looser
        w1 = markov_w1.weight.float()
        if len(self.w2) <= EXACT_REACH_ROWS:
            self.reach = torch.cat([(chunk @ self.w2.T).amax(-1) for chunk in w1.split(REACH_CHUNK)]) + ROUNDING
        else:
            self.reach = float(self.w2.norm(dim=-1).max()) * w1.norm(dim=-1) + ROUNDING

    def shortlist(self, base: torch.Tensor, num: int) -> Shortlist:
        """base: [..., rows] the draft slots' backbone logits -> their shortlists (of at least `num` tokens, the
        children a node takes), made once per step."""
        size = base.shape[-1]
        listed = min(max(SHORTLIST, num), size)
        values, rows = base.topk(min(listed + 1, size), dim=-1)
        if listed == size:  # the whole vocabulary is listed: nothing lies beyond it
            values = torch.cat([values, torch.full_like(values[..., :1], -torch.inf)], dim=-1)
        return Shortlist(values, rows[..., :listed])

    def rows_of(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [..., K] -> [..., K, rank] those rows of W2 (index_select: a few rows, gathered without the threads
        advanced indexing starts, which a busy core stalls)."""
        return self.w2.index_select(0, rows.flatten()).view(*rows.shape, -1)

    def table(self, base: torch.Tensor, shortlist: Shortlist, previous: torch.Tensor, embed: torch.Tensor,
              num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """base: [R, D, rows] the draft slots' backbone logits and shortlist theirs; previous: [R, D, P] target ids of
        P possible previous tokens per slot and embed [R, D, P, rank] their Markov embeddings -> (the `num` largest of
        base + W2 @ embed and their rows, each [R, D, P, num], descending; [R, D, P] true where those may be wrong: a
        token off the shortlist may beat them)."""
        values, rows = shortlist
        *slots, num_previous, rank = embed.shape
        w2 = self.rows_of(rows).view(-1, rows.shape[-1], rank)  # [R * D, listed, rank]
        exact = torch.baddbmm(values[..., :-1].reshape(-1, 1, rows.shape[-1]), embed.float().view(-1, num_previous, rank),
                              w2.transpose(1, 2)).view(*slots, num_previous, -1)  # [R, D, P, listed]
        best, at = exact.topk(num, dim=-1)
        missed = values[..., -1:] + self.reach[previous] >= best[..., -1]
        return best, rows[..., None, :].expand(exact.shape).gather(-1, at), missed

    def top(self, base: torch.Tensor, index: torch.Tensor, depth: int, shortlist: Shortlist, previous: torch.Tensor,
            embed: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
        """base: [R, D, rows] the draft slots' backbone logits and shortlist theirs; index: [N] the requests of N nodes
        at slot `depth`; previous: [N] the nodes' target ids and embed [N, rank] their Markov embeddings -> (the `num`
        largest of base + W2 @ embed per node, [N, num], descending; their rows, [N, num])."""
        values, rows = shortlist.values[index, depth], shortlist.rows[index, depth]
        exact = torch.baddbmm(values[:, :-1, None], self.rows_of(rows), embed.float()[:, :, None]).squeeze(-1)
        best, at = exact.topk(num, dim=-1)
        # no token off the shortlist has a logit above the largest base logit there plus its reach
        missed = (values[:, -1] + self.reach[previous] >= best[:, -1]).nonzero().squeeze(-1)
        rows = rows.gather(1, at)
        if len(missed):
            full = base[index[missed], depth] + self.markov_w2(embed[missed])
            best[missed], rows[missed] = full.topk(num, dim=-1)
        return best, rows
