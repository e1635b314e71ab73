"""The one interface every drafter implements.

A drafter proposes, for each request that has just emitted a token (K/V computed for all but that one), a token tree
(`serving.spec_decode.tree.DraftTree`) of at most `budget.num_nodes` rows (its nodes, and its lookahead rows where it has
them) and depth `budget.depth`; a longer or deeper one is cut. What a drafter reads from the target's pass is
declared here, never probed:
- `needs_hidden`: the target's final hidden states of every computed row (Medusa, EAGLE, MTP);
- `aux_layers`: target layers whose inputs it reads too (EAGLE-3);
- `is_calibrated`: its drafts carry a calibrated confidence and it honours `DraftBudget.min_log_survival` and
  `row_prices` (the heads): the adaptive policy then trusts the drafter's acceptance over all requests for each step's depth and
  leaves each draft's fate to that cut, rather than one request's few recent verify steps;
- `num_lookahead`: tokens after a block that its own K/V there depends on, so that the prefix cache shares a block
  only where those tokens agree too (EAGLE and MTP: their entry at position p reads token p + 1).
A drafter sees a `DraftContext` (serving/drafters/context.py: the model runner, the engine's limits, the step's
outputs), never the engine. Its state for one request lives in that request's slot, `request.spec.slots[drafter]`,
which the speculator clears when the request finishes, is preempted or aborted.
`observe(ctx)` runs every step, before requests finishing in it leave and before `propose`, for drafters that catch
up over what the target kept; a drafter with a K/V pool of its own may defer that work until a request drafts
(`catch_up`), handing what it deferred to the blocks the prefix cache registers (`registered`), so that a request
sharing them completes it when it drafts; `summary()` is what a drafter reports beside the acceptance counts
(lookahead: its pool's hit rate).
A drafter class names the methods or head kinds it serves (`kinds`, gathered into serving/drafters/__init__.py's
table), refuses the options it cannot honour (`check`) and is built from the speculative config (`build`).
"""
from __future__ import annotations

import abc
import math
from typing import NamedTuple

from serving.drafters.context import DraftContext
from serving.spec_decode.tree import DraftTree


class DraftBudget(NamedTuple):
    # the tree's rows at most (nodes, lookahead rows): they fit in the token budget, the free blocks and the context
    num_nodes: int
    depth: int  # its depth at most: num_speculative_tokens, and the tokens max_tokens leaves
    # a head keeps no node whose path log-probability (its calibrated confidence) is below this: the adaptive
    # policy's price of its cheapest row (serving/spec_decode/adaptive.py); drafters without a confidence ignore it
    min_log_survival: float = -math.inf
    # the survival (path probability) the i-th best node must bring to repay the row it adds to the step, as the
    # adaptive policy prices each further row; a step's cost is uneven in its rows (a few rows stream the weights
    # as one does, more run as tiles), so one price for every row would drop cheap rows or keep dear ones. Empty:
    # every node above min_log_survival repays its row.
    row_prices: tuple[float, ...] = ()
    # a drafter whose every further depth is a forward of its own (EAGLE's, MTP's) drafts the children of a node at
    # depth d only where the node's path log-probability is at least entry d - 1: where the children it may expect
    # (its survival times the drafter's acceptance at depth d + 1) repay that forward and their row. Empty: always.
    min_log_expand: tuple[float, ...] = ()

    @property
    def chain_length(self) -> int:
        """The drafts of a chain within this budget."""
        return min(self.num_nodes, self.depth)

    def expands(self, depth: int, log_survival: float) -> bool:
        """Whether a node at `depth` with this path log-probability is worth a forward for its children."""
        return depth > len(self.min_log_expand) or log_survival >= self.min_log_expand[depth - 1]

    def num_kept(self, survivals) -> int:
        """How many of a draft's best nodes to keep, given their survivals best first (non-increasing): at most
        num_nodes, and among those the prefix whose survivals exceed their rows' prices by the most in sum (a dear
        row is kept where the cheaper rows after it repay it; no node where no prefix gains)."""
        num = min(len(survivals), self.num_nodes)
        if not self.row_prices:
            return num
        kept, total, most = 0, 0.0, 0.0
        for i in range(num):
            total += survivals[i] - self.row_prices[min(i, len(self.row_prices) - 1)]
            if total > most:
                kept, most = i + 1, total
        return kept


class Drafter(abc.ABC):
    kinds: tuple[str, ...] = ()  # the methods, or for heads the kinds (serving/drafters/head.py, drafter_kind), it serves
    needs_hidden: bool = False
    aux_layers: tuple[int, ...] = ()
    is_calibrated: bool = False
    num_lookahead: int = 0

    @classmethod
    def check(cls, config, ctx, head=None) -> None:
        """Raises a ValueError naming an option of the speculative config `config` this drafter cannot honour on
        ctx's target (and, for a head drafter, with the loaded `head`). SpeculativeConfig checks the options alone."""

    @classmethod
    def build(cls, ctx, config, head=None, token_map=None) -> "Drafter":
        """The drafter of `config` (for a head drafter: of the loaded, bound `head` and its token map), checked."""
        cls.check(config, ctx, head)
        return cls(config)

    @abc.abstractmethod
    def propose(self, ctx: DraftContext, requests: list, budgets: dict[str, DraftBudget]) -> dict[str, DraftTree]:
        """A tree per request id (a request left out gets none). `ctx.step` is the target pass that just ran."""

    def observe(self, ctx: DraftContext) -> None:
        """Note what the target kept this step (`ctx.step`), every request of it, finishing ones included."""

    def reset(self, request) -> None:
        """Forget a request: for state a drafter keeps beyond the request's own slot (`request.spec.slots`), which
        the speculator clears."""

    def summary(self) -> dict:
        """What this drafter reports beside the acceptance counts (the bench adds it to the method's row)."""
        return {}

    # For a drafter with a K/V pool of its own addressed by the target's block tables (a draft model's, a head's):

    def catch_up(self, ctx: DraftContext, requests: list) -> int:
        """Before drafting for `requests`: complete the work `observe` deferred for them and for the shared blocks
        they hold. Only drafting pays for it, so the adaptive policy prices this call with drafting. Returns the
        rows it ran over."""
        return 0

    def registered(self, request, first_block: int) -> None:
        """The prefix cache registered the request's blocks from index `first_block` to len(request.block_hashes),
        and may share them from now on: a drafter that defers its pool's work keeps what those blocks still need."""
