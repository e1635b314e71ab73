"""DSpark (heads/dspark.py) as a drafter: DFlash's drafter (drafters/dflash.py: the context pool, one forward of the
block per step) with the Markov head's left-to-right pass over the block's outputs.

The block's forward gives every draft slot's backbone logits at once; the drafts then follow one another, each
node's children scored by the backbone logits of the next slot plus the transition bias of the node's own token
(W2 @ W1[token]), the newest token's for depth 1. A chain (topk 1) is the sequential greedy pass vLLM's DSpark
speculator makes; a tree (topk > 1) grows by the same best-first search as every head's (drafters/tree_search.py,
`grow`), expanding each depth's best nodes in one batched call: each node's children come from its own conditional
distribution, which is exactly the head's first-order law, not a product of per-depth marginals.

A node's score, its estimate of surviving verification, is where the confidence head enters: a head with one scores
the most likely child of a node sigmoid(confidence(slot output, W1[node's token])), the learned probability that the
target accepts it, and each other child that times its probability relative to the most likely one (the confidence
head judges the position, the head's distribution ranks the candidates there). The adaptive policy's price of a row
(`DraftBudget.min_log_survival`) and `confidence_threshold` cut a path whose product falls below them, so the learned
estimate sizes each request's draft as the calibrated probability does for other heads. A head without a confidence
head scores children by their calibrated probabilities, as DFlash's drafter does.

A head over a short token map holds the bias after every token of the map (drafters/markov.py, `Transitions`), so a
node whose token is in the map reads its bias as one row of that table. Otherwise, since relative scores need no normaliser
over the vocabulary, with a confidence head the Markov step (`MarkovStep`) finds a node's best children from the rows
of W2 of the backbone's shortlist, computing the full product over W2 only for a node whose bias could reach past it:
the same children, without reading all of W2 at every depth. A head with neither takes the full product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from serving.drafters.confidence import top_log_probs
from serving.drafters.dflash import DFlashDrafter
from serving.drafters.markov import TRANSITION_ROWS, MarkovStep, Shortlist, Transitions
from serving.drafters.tree_search import grow

TOKEN_CHUNK = 4096  # tokens per product while the confidence of every token is made (bounds its scratch memory)
# The table holds the children of this many of a slot's shortlisted tokens, the backbone's most likely: a node whose
# token is further down (the bias lifted it there) has its children computed when the search reaches it.
TABLE_PARENTS = 16
# The table pays where it answers nearly every lookup: where it answers fewer, the nodes it misses pay the full
# product on top of it. After a step whose table answered under this share, the drafter drafts TABLE_RETRY steps by
# the full product before it tries the table again.
TABLE_HELD = 0.9
TABLE_RETRY = 64


class ChildrenTable:
    """The children of every node a step's search may reach without the bias lifting a token from beyond a shortlist
    (drafters/markov.py, `table`): of the newest token at depth 0, of the TABLE_PARENTS best tokens of slot d-1's
    shortlist at depth d, as nested lists the search reads without a tensor operation per depth."""

    def __init__(self, log_probs: list, tokens: list, missed: list, parents: list):
        """log_probs, tokens: [R][D][P][topk] the log-scores and target ids of the children of parents[r][d][p] at
        depth d; missed: [R][D][P] where they may be wrong; parents: [R][D][P] target ids (at depth 0 the newest
        token, P times)."""
        self.log_probs, self.tokens, self.missed = log_probs, tokens, missed
        self.positions = [[{token: p for p, token in enumerate(slot)} for slot in request] for request in parents]
        self.held = self.asked = 0  # lookups it answered, and all

    def get(self, r: int, depth: int, token: int) -> tuple[list, list] | None:
        """(log-scores, target ids) of the children of request r's node holding `token` at depth `depth`, or None
        where the table does not hold them exactly."""
        self.asked += 1
        p = self.positions[r][depth].get(token)
        if p is None or self.missed[r][depth][p]:
            return None
        self.held += 1
        return self.log_probs[r][depth][p], self.tokens[r][depth][p]


class DSparkDrafter(DFlashDrafter):
    kinds = ("dspark",)

    def __init__(self, ctx, head, token_map, config):
        super().__init__(ctx, head, token_map, config)
        self.transitions = None  # every bias between draft tokens: only a head with a short enough token map
        if token_map is not None and len(token_map) <= TRANSITION_ROWS:
            with torch.inference_mode():
                self.transitions = Transitions(head.markov_w1, head.markov_w2, token_map)
        self.markov = None  # scores relative to the best child need no normaliser: only a confidence head's do
        self.table_off = 0  # steps left without the table
        if head.confidence is not None:
            if self.transitions is None:
                self.markov = MarkovStep(head.markov_w1, head.markov_w2)
            # The confidence logit is affine in the Markov embedding: logit(out, e) = logit(out, 0) + what e adds,
            # which depends on the previous token alone (zero where the head does not read e), made once here.
            with torch.inference_mode():
                w1 = head.markov_w1.weight
                zeros = w1.new_zeros(TOKEN_CHUNK, head.config.hidden_size)
                at_zero = head.confidence_logit(zeros[:1], torch.zeros_like(w1[:1]))
                self.token_confidence = torch.cat([head.confidence_logit(zeros[:len(chunk)], chunk) - at_zero
                                                   for chunk in w1.split(TOKEN_CHUNK)]).float()
            self.zero_embed = torch.zeros(head.config.markov_rank, device=self.device)
            self.temperatures = torch.tensor([self.confidence.temperature(d + 1) for d in range(head.config.num_drafts)],
                                             device=self.device)

    def table_pays(self) -> bool:
        """Whether this step builds the table: not for TABLE_RETRY steps after one whose table answered under
        TABLE_HELD of the search's lookups (a Markov bias so large that the bound often fails to rule out the tokens
        off the shortlists: then the full product per node costs less than the table and the nodes it does not
        hold)."""
        if self.table_off:
            self.table_off -= 1
            return False
        return True

    @classmethod
    def check(cls, config, ctx, head=None):
        c = head.config
        if config.num_speculative_tokens > c.num_drafts:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds the {c.num_drafts} drafts "
                             f"of this DSpark head's block (block_size={c.block_size}, sample_from_anchor="
                             f"{str(c.sample_from_anchor).lower()}): draft fewer tokens, or train a head with longer "
                             "blocks")

    def markov_bias(self, previous: torch.Tensor) -> torch.Tensor:
        """previous: [N] target ids -> [N, rows] the Markov bias each gives the next draft's logits: rows of the
        transition table where it holds them all, else the product over W2."""
        bias = self.transitions.after(previous) if self.transitions is not None else None
        return bias if bias is not None else self.head.markov_w2(self.head.markov_embed(previous))

    def children(self, accept_at_zero: torch.Tensor | None, base: torch.Tensor, shortlist: Shortlist | None,
                 index: torch.Tensor, depth: int, previous: torch.Tensor):
        """accept_at_zero: [R, D] the confidence logit of each draft slot's output with a zero Markov embedding (None
        without a confidence head), base: [R, D, rows] the slots' backbone logits, shortlist their shortlists
        (drafters/markov.py; None without one); index: [N] the requests of N nodes at depth `depth` (0: the newest
        token), previous: [N] those nodes' target ids -> (their topk children's log-scores, their target ids) as
        nested lists."""
        temperature = self.confidence.temperature(depth + 1)
        if shortlist is not None:
            logits = None
            top, tokens = self.markov.top(base, index, depth, shortlist, previous, self.head.markov_embed(previous),
                                          self.topk)
        else:
            logits = base[index, depth] + self.markov_bias(previous)
        if accept_at_zero is None:  # calibrated probabilities: the normaliser over every row
            log_probs, tokens = top_log_probs(logits, self.topk, temperature)
        else:  # scores relative to the best child
            if logits is not None:
                top, tokens = logits.topk(self.topk, dim=-1)
            accept = F.logsigmoid(accept_at_zero[index, depth] + self.token_confidence[previous])
            log_probs = accept[:, None] + (top - top[:, :1]) / temperature
        if self.token_map is not None:
            tokens = self.token_map[tokens]
        return log_probs.tolist(), tokens.tolist()

    def children_table(self, accept_at_zero: torch.Tensor, base: torch.Tensor, shortlist: Shortlist,
                       newest: torch.Tensor) -> ChildrenTable:
        listed = shortlist.rows if self.token_map is None else self.token_map[shortlist.rows]  # [R, D, L] target ids
        num_parents = min(TABLE_PARENTS, listed.shape[-1])
        parents = torch.cat([newest[:, None, None].expand(-1, 1, num_parents), listed[:, :-1, :num_parents]], dim=1)
        logits, tokens, missed = self.markov.table(base, shortlist, parents, self.head.markov_embed(parents), self.topk)
        accept = F.logsigmoid(accept_at_zero[..., None] + self.token_confidence[parents])
        temperatures = self.temperatures[:base.shape[1], None, None]
        log_probs = accept[..., None] + (logits - logits[..., :1]) / temperatures
        if self.token_map is not None:
            tokens = self.token_map[tokens]
        return ChildrenTable(log_probs.tolist(), tokens.tolist(), missed.tolist(), parents.tolist())

    def chain_table(self, accept_at_zero: torch.Tensor | None, base: torch.Tensor, newest: torch.Tensor) -> ChildrenTable:
        """Chains (topk 1) over the transition table: every request's greedy chain at once, one add, argmax and
        gather per depth over all requests, as the table of each chain node's one child."""
        bias = self.markov_bias(newest)
        logits, rows = [], []
        for depth in range(base.shape[1]):
            logits.append(base[:, depth] + bias)
            rows.append(logits[-1].argmax(-1))
            bias = self.transitions.bias.index_select(0, rows[-1])
        tokens = self.token_map[torch.stack(rows, 1)]  # [R, D] target ids
        parents = torch.cat([newest[:, None], tokens[:, :-1]], dim=1)
        if accept_at_zero is None:  # calibrated probabilities
            log_probs = torch.stack([(x.float() / self.confidence.temperature(d + 1)).log_softmax(-1).gather(
                -1, row[:, None])[:, 0] for d, (x, row) in enumerate(zip(logits, rows))], dim=1)
        else:  # the best child's score: the confidence head's alone
            log_probs = F.logsigmoid(accept_at_zero + self.token_confidence[parents])
        return ChildrenTable(log_probs[..., None, None].tolist(), tokens[..., None, None].tolist(),
                             torch.zeros_like(parents, dtype=torch.bool)[..., None].tolist(), parents[..., None].tolist())

    @torch.inference_mode()
    def _draft(self, ctx, requests, budgets):
        c = self.head.config
        newest = torch.tensor([r.token_ids[-1] for r in requests], device=self.device)
        depths = [min(c.num_drafts, budgets[r.request_id].depth) for r in requests]
        first = c.draft_slot(1)
        rows = self.block_outputs(ctx, requests, newest)[:, first:first + max(depths)]  # [R, D, hidden]
        base = self.head.logits(rows)  # [R, D, rows]: the backbone's part of every draft's logits
        accept_at_zero = None
        if self.head.confidence is not None:
            accept_at_zero = self.head.confidence_logit(rows, self.zero_embed.expand(*rows.shape[:-1], -1)).float()
        shortlist = table = None
        if self.topk == 1 and self.transitions is not None:
            table = self.chain_table(accept_at_zero, base, newest)
        elif self.markov is not None and self.table_pays():
            shortlist = self.markov.shortlist(base, self.topk)
            table = self.children_table(accept_at_zero, base, shortlist, newest)

        def children_of(depth, nodes):
            """nodes: (request index, target id) at depth `depth` -> their children, from the table where it holds
            them."""
            held = [table.get(r, depth, token) if table is not None else None for r, token in nodes]
            direct = [i for i, children in enumerate(held) if children is None]
            if direct:
                index = torch.tensor([nodes[i][0] for i in direct], device=self.device)
                previous = torch.tensor([nodes[i][1] for i in direct], device=self.device)
                for i, *children in zip(direct, *self.children(accept_at_zero, base, shortlist, index, depth, previous)):
                    held[i] = children
            return [children[0] for children in held], [children[1] for children in held]

        def expand(depth, nodes, found):
            return children_of(depth, [(r, found[r].tokens[node]) for r, node in nodes])

        found = grow(children_of(0, list(enumerate(newest.tolist()))), expand, self.topk, depths,
                     [self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests])
        if table is not None and table.held < TABLE_HELD * table.asked:
            self.table_off = TABLE_RETRY
        return {r.request_id: candidates.within(budgets[r.request_id]) for r, candidates in zip(requests, found)}
