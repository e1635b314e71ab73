"""The adaptive policy (`"adaptive": true`): each step, how deep a tree each request gets, 0 included, chosen for the
whole batch to maximise the tokens the next step is expected to emit per second it is expected to take.

A request drafted to depth j is expected to emit 1 + S_1 + ... + S_j tokens, where S_d = c_1 * ... * c_d is its
survival to depth d and c_i its conditional acceptance at depth i (docs/design.md, "Measuring acceptance"), estimated from
its own verify steps with older steps weighing less (`Estimate`), around a prior: the drafter's conditional
acceptance over every request so far, itself drawn toward PRIOR at depth 1 and toward 1 deeper as if PRIOR_TRIES
tries had found it (`prior`), so that the first steps, before anything was verified, neither draft everything nor
nothing, and a deeper depth seldom tried is tried. A depth not tried in a step slowly forgets, back to the prior, so
a request whose drafts stopped paying is tried again after a while when drafting is cheap enough that the prior
repays it.

The next step's time is the target's step over the emitting requests' rows (`serving.spec_decode.cost.StepCost`, plus the
engine's own work per step, learned from the steps it times: `overhead_s`), plus what the drafts' rows add to the
whole step, prefill chunks included, plus one drafting call (`DraftCost`). Prefill chunks are left out of the
step's rate: they are owed whatever is drafted, and a rate diluted by a long chunk makes a few draft rows beside it
look nearly free, so that every decoding request would draft deep (and a head catch up over its whole prompt) in
the very steps where drafting pays least (docs/benchmarks/adaptive.md).
Each further depth of each request is one candidate, worth its survival per added row; candidates are taken best
first (never depth j + 1 before depth j), and the prefix with the most tokens per second wins, the empty prefix (no
drafts) among them. A tree setting drafts `num_nodes[j]` nodes at depth j: the config's num_draft_tokens - 1 scaled
by j / num_speculative_tokens (for medusa_choices: its choices up to depth j); its per-depth acceptance is the full
tree's (measured at the depths a step reached), an approximation for cut trees.

A trained head (`Drafter.is_calibrated`) is judged differently: c_i is the drafter's acceptance over every request
(the prior), not one request's few recent steps (`per_request` off), because the head then sees its own drafts
before they are verified, and its calibrated probability of a path is a better estimate, for this step, of that
path's survival than any history. A node repays its row when that survival is at least the step's rate (tokens per
second) times what its row adds to the step, so each budget carries those prices row by row (`row_prices`: a step's
cost is uneven in its rows, and one price for all of them, that of the row past the budget, dropped first drafts
whose rows were nearly free) and the cheapest as `min_log_survival`, below which the head keeps no node
(drafters/confidence.py, the confidence cut); of the rest it keeps the best nodes that repay their rows most
(`DraftBudget.num_kept`). A head whose every further depth is a forward of its own (EAGLE's, MTP's) runs it only
for nodes whose survival, times the drafter's acceptance one depth deeper, repays that forward and a row
(`min_log_expand`): the policy's depth is a cap, and the head's confidence in the draft in hand says where to stop.
A request's few recent verify steps are noise beside the head's calibrated probability of the draft in hand.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from serving.drafters.base import DraftBudget
from serving.spec_decode.cost import DraftCost, StepCost

DECAY = 0.6  # weight of the steps before, per step that tried a depth: about the last 2.5 steps count
IDLE_DECAY = 0.9  # per step that did not
PRIOR_WEIGHT = 0.5  # a request's prior counts as this many of its tries
PRIOR, PRIOR_TRIES = 0.5, 8  # conditional acceptance at depth 1 before anything was verified, and its weight
OVERHEAD_DECAY = 0.9  # weight of the steps before in the learned per-step overhead
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1 << 30)  # the summary's step-time buckets, by rows at most
MIN_GAIN = 1e-6  # a prefix must beat a shorter one by this fraction, not tie it
# a calibrated drafter's survivals against what verification finds, per depth: the weight of the steps before, per
# step that drafted the depth (about the last hundred count), and the tokens of agreement assumed before any
REALISM_DECAY, REALISM_PRIOR = 0.99, 4.0


@dataclass
class Estimate:
    """One request's decayed counts of accepted and tried drafts per depth."""
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)

    def update(self, num_tried: int, num_accepted: int, depth: int) -> None:
        """One verify step whose tree reached `depth`, tried depths 1..num_tried and accepted 1..num_accepted."""
        num = max(depth, len(self.hits))
        self.hits += [0.0] * (num - len(self.hits))
        self.tries += [0.0] * (num - len(self.tries))
        for i in range(num):
            if i < num_tried:
                self.hits[i] = DECAY * self.hits[i] + (i < num_accepted)
                self.tries[i] = DECAY * self.tries[i] + 1
            else:
                self.hits[i] *= IDLE_DECAY
                self.tries[i] *= IDLE_DECAY

    def conditional(self, i: int, prior: float) -> float:
        """Estimated acceptance at depth i + 1 given depth i was accepted."""
        hits, tries = (self.hits[i], self.tries[i]) if i < len(self.hits) else (0.0, 0.0)
        return (hits + PRIOR_WEIGHT * prior) / (tries + PRIOR_WEIGHT)


class AdaptivePolicy:
    def __init__(self, config, step_cost: StepCost, draft_cost: DraftCost, per_request: bool = True):
        self.config, self.step_cost, self.draft_cost = config, step_cost, draft_cost
        self.per_request = per_request  # estimate each request's acceptance from its own history, else the drafter's
        self.max_depth = k = config.num_speculative_tokens
        # draft nodes of a tree cut at each depth 0..k
        if config.medusa_choices is not None:
            self.num_nodes = tuple(sum(len(path) <= d for path in config.medusa_choices) for d in range(k + 1))
        else:
            self.num_nodes = tuple(max(d, math.ceil(config.max_draft_nodes * d / k)) for d in range(k + 1))
        self.forced_depth: int | None = None  # calibration drafts every request to this depth
        self.chosen: dict[int, Counter] = defaultdict(Counter)  # running requests -> chosen depth -> times
        # bucket of rows (at most) -> [steps, predicted s, measured s] summed: bounded however long the engine serves
        self.timings: dict[int, list] = defaultdict(lambda: [0, 0.0, 0.0])
        self.overhead_s = 0.0  # what an engine step takes beyond the step cost table's forward, learned as steps come
        # per depth, decayed: the survival a calibrated drafter gave the nodes it drafted there, and the steps that
        # accepted one of them (`realism`)
        self.expected, self.found = [0.0] * k, [0.0] * k

    @property
    def overhead(self) -> float:
        """The learned overhead as priced: never below zero."""
        return max(self.overhead_s, 0.0)

    def step_time(self, num_rows: int, num_seqs: int, num_logits_rows: int | None = None) -> float:
        return self.step_cost.predict(num_rows, num_seqs, num_logits_rows) + self.overhead

    def choose(self, scheduler, ready: list, limits: dict[str, DraftBudget], prior: list[float]) -> dict[str, DraftBudget]:
        """limits: what each ready request may carry at most (blocks, tokens, context, max_tokens); prior: the
        drafter's conditional acceptance at each depth up to num_speculative_tokens (`prior`). Returns the budgets of
        the requests that draft."""
        if self.forced_depth is not None:
            return {rid: DraftBudget(min(limit.num_nodes, self.num_nodes[self.forced_depth]), min(limit.depth, self.forced_depth))
                    for rid, limit in limits.items()}
        num_rows, num_emitting, spare = 0, 0, scheduler.max_num_batched_tokens
        for request in scheduler.running:
            num = min(request.num_tokens - request.num_computed_tokens, spare)
            num_rows += num
            spare -= num
            num_emitting += request.num_computed_tokens + num == request.num_tokens
        num_seqs = len(scheduler.running)
        # A second is worth what decoding alone earns in it: the step's prefill chunks are owed whatever is drafted,
        # and beside them (hundreds of rows, no tokens) any draft would look cheap. So the step is priced as its
        # decoding rows alone, plus what the drafts add to the whole step's time. Rows with logits: the newest token of
        # each request that emits one (a chunk ending mid-prompt has none), and every draft row.
        whole = self.step_cost.predict(num_rows, num_seqs, num_emitting)
        decoding = self.step_time(num_emitting, num_emitting, num_emitting)
        candidates = []  # (worth per row, depth, request id, survival, rows)
        ready = [request for request in ready if request.request_id in limits]
        for request in ready:
            limit = limits[request.request_id]
            estimate = self.estimate(request) if self.per_request else None
            survival, worth = 1.0, math.inf
            for depth in range(1, limit.depth + 1):
                num_new = self.num_nodes[depth] - self.num_nodes[depth - 1]
                if self.num_nodes[depth] > limit.num_nodes:
                    break
                drafter_rate = prior[depth - 1]
                survival *= estimate.conditional(depth - 1, drafter_rate) if self.per_request else drafter_rate
                worth = min(worth, survival / num_new)
                candidates.append((worth, depth, request.request_id, survival, num_new))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        best_rate = max(num_emitting, 1) / decoding  # no drafts
        best, best_rows = 0, 0
        # every prefix of the candidates, in plain Python: after the target's forward has streamed the weights
        # through the caches, each numpy call costs tens of microseconds, and a step at concurrency 1 prices a few
        tokens, rows, deepest = float(num_emitting), 0, 0
        for n, (_, depth, _, survival, num_new) in enumerate(candidates):
            tokens, rows, deepest = tokens + survival, rows + num_new, max(deepest, depth)
            seconds = (decoding + self.step_cost.predict(num_rows + rows, num_seqs, num_emitting + rows) - whole
                       + self.draft_cost.predict(deepest, rows))
            if tokens / seconds > best_rate * (1 + MIN_GAIN):
                best, best_rate, best_rows = n + 1, tokens / seconds, rows
        depths = {request.request_id: 0 for request in ready}
        for _, depth, rid, _, _ in candidates[:best]:
            depths[rid] = max(depths[rid], depth)
        for depth in depths.values():
            self.chosen[num_seqs][depth] += 1
        nodes = {rid: min(limits[rid].num_nodes, self.num_nodes[depth]) for rid, depth in depths.items() if depth > 0}
        if not nodes:
            return {}
        # A row repays itself when its survival is at least the step's rate times what it adds to the step. Each
        # request's rows come after the other requests' chosen ones.
        seconds = [self.step_cost.predict(num_rows + added, num_seqs, num_emitting + added)
                   for added in range(best_rows + 1)]
        prices = [best_rate * (later - earlier + self.draft_cost.per_node) for earlier, later in zip(seconds, seconds[1:])]
        # A calibrated head decides each further depth knowing its own confidence in the nodes above: their children
        # are worth a forward where a node's survival, times the drafter's acceptance one depth deeper, repays that
        # forward and the row of its first child. A forward is priced at what a catch-up call costs (one head forward
        # over a few rows, as a depth is) or the drafting calls' price of a depth where that is more: the drafting
        # calls are fitted on the budgets' depths, deeper than a head that stops on its confidence drafts.
        per_depth = best_rate * max(self.draft_cost.call.coef[1], self.draft_cost.catch_up.coef[0])
        # Both are asked of the drafter's survivals, so a drafter that proves more sure than right (a head on prompts
        # unlike its training data) is asked for more in proportion (`realism`).
        realism = [1.0] * len(self.expected) if self.per_request else [self.realism(d) for d in range(1, len(self.expected) + 1)]
        rank_realism = [realism[d - 1] for d in range(1, len(self.num_nodes))  # of a tree's i-th best node
                        for _ in range(self.num_nodes[d] - self.num_nodes[d - 1])]
        budgets = {}
        for rid, num in nodes.items():
            first = best_rows - num
            own = prices[first:first + num]
            asked = tuple(price / rank_realism[i] for i, price in enumerate(own))
            # a node at depth d, worth realism[d - 1] of its survival, expects its children to be accepted prior[d]
            # of the times it is
            expand = () if self.per_request else tuple(
                _log((per_depth + own[min(self.num_nodes[d], num - 1)]) / (realism[d - 1] * prior[d]))
                if prior[d] > 0 else math.inf for d in range(1, depths[rid]))
            least = min(asked)
            budgets[rid] = DraftBudget(num, depths[rid], _log(least), asked, expand)
        return budgets

    def realism(self, depth: int) -> float:
        """Steps that accepted a node at `depth` per unit of survival a calibrated drafter gave its nodes there, over
        recent steps (1 before any): its calibration as this workload finds it."""
        return (self.found[depth - 1] + REALISM_PRIOR) / (self.expected[depth - 1] + REALISM_PRIOR)

    def record_survivals(self, tree, num_accepted: int) -> None:
        """A verified tree that carried its drafter's survivals, of which `num_accepted` nodes were accepted."""
        expected = [0.0] * tree.depth
        for depth, survival in zip(tree.depths, tree.survivals):
            expected[depth - 1] += survival
        for d, value in enumerate(expected[:len(self.expected)]):
            self.expected[d] = REALISM_DECAY * self.expected[d] + value
            self.found[d] = REALISM_DECAY * self.found[d] + (num_accepted > d)

    @staticmethod
    def estimate(request) -> Estimate:
        """The request's estimate (`request.spec.estimate`), made on first use."""
        if request.spec.estimate is None:
            request.spec.estimate = Estimate()
        return request.spec.estimate

    def record(self, request, num_tried: int, num_accepted: int, depth: int) -> None:
        if self.per_request:
            self.estimate(request).update(num_tried, num_accepted, depth)

    def record_step(self, num_rows: int, num_seqs: int, num_logits_rows: int, seconds: float, has_prefill: bool) -> None:
        """An engine step of `num_rows` rows, `num_logits_rows` of them with logits, took `seconds` before drafting:
        its prediction and measure go to the summary, and what it took beyond the table's forward to the learned
        overhead, unless it computed a prefill chunk: the table prices a chunk's attention at its measured context,
        above most prompts', which would pull the overhead below what decode steps, where drafting is chosen, take
        (docs/benchmarks/adaptive.md: predicted against measured step time)."""
        totals = self.timings[next(b for b in ROW_BUCKETS if num_rows <= b)]
        forward = self.step_cost.predict(num_rows, num_seqs, num_logits_rows)
        totals[0] += 1
        totals[1] += forward + self.overhead
        totals[2] += seconds
        if not has_prefill:
            self.overhead_s = OVERHEAD_DECAY * self.overhead_s + (1 - OVERHEAD_DECAY) * (seconds - forward)

    def summary(self) -> dict:
        """The chosen depths per number of running requests, and the cost model's predicted against measured step
        time per bucket of rows."""
        timing = [{"rows_at_most": bucket, "steps": steps, "predicted_ms": predicted / steps * 1e3,
                   "measured_ms": measured / steps * 1e3, "error": predicted / measured - 1}
                  for bucket, (steps, predicted, measured) in sorted(self.timings.items())]
        return {"chosen_depths": {n: dict(sorted(c.items())) for n, c in sorted(self.chosen.items())},
                "step_time": timing, "overhead_ms": self.overhead_s * 1e3, "draft_cost": self.draft_cost.summary()}


def _log(price: float) -> float:
    return math.log(price) if price > 0 else -math.inf


def prior(stats) -> list[float]:
    """The drafter's conditional acceptance per depth over every request so far (serving.spec_decode.metrics.AcceptanceStats),
    drawn toward PRIOR at depth 1 and toward 1 deeper, as if found in PRIOR_TRIES further tries: once a draft was
    right the next one is right more often (conditional acceptance grows with depth), and a depth tried too seldom to tell must be tried to be learnt;
    its cost is bounded by the survival to the depth before."""
    return [(p["accepted"] + (PRIOR if p["position"] == 1 else 1.0) * PRIOR_TRIES) / (p["reached"] + PRIOR_TRIES)
            for p in stats.per_position()]
