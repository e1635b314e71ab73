"""The engine's speculation, in the order a step calls it: `verify` each request's draft tree and roll back (or
`record_undrafted` a plain step), `observe` what the target kept, then `propose` the trees of the next step.

Rollback is `num_computed_tokens = before + 1 + accepted` and `trim`: nothing is erased, and the slots of rejected
nodes are overwritten later. Node i of a tree computed in the slot of position (newest) + 1 + i; an accepted node
at depth d belongs in the slot of position (newest) + d, so each accepted node off that slot has its K/V copied
there (none for a chain, whose node i is at depth i + 1). Trees are capped so that they fit in the token budget, the
free blocks, max_tokens and the context: speculation never causes a preemption. Requests whose sampling depends on
more than the target's distribution (penalties, biases) get no drafts and decode one token per step beside
the others. Structured-output requests speculate (serving/spec_decode/grammar.py): their drafts are cut to what the
grammar allows, the tokens it forces are drafted too (up to num_speculative_tokens rows beyond the drafter's), and
every verified row's law is masked by the grammar state after its path. With `adaptive`,
serving/spec_decode/adaptive.py chooses each request's tree within those caps.

`propose` runs five steps in order: budgets -> reserve -> draft -> constrain -> trim. Its sizes, all counted in rows
a request's verify step adds after its newest token (tree nodes, grammar-forced rows, lookahead rows):
- max rows: the most the config lets a request verify (max_draft_nodes, plus num_speculative_tokens grammar rows);
- room: what the scheduler can give it next step within max rows (token budget, free blocks, context);
- cap: a DraftBudget of the room's nodes (at most max_draft_nodes) and the depth its max_tokens leaves;
- budget: the DraftBudget it drafts within: its cap, or what the adaptive policy chooses inside it;
- reserved: the rows whose blocks are allocated for it (the budget's nodes, plus grammar rows within its room);
  after drafting, the blocks past its tree are trimmed.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from serving.drafters import make_drafter
from serving.drafters.base import DraftBudget
from serving.drafters.context import DraftContext, StepOutputs
from serving.request import Request, SamplingParams
from serving.sampler import target_probs
from serving.spec_decode.adaptive import AdaptivePolicy, prior
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.cost import DraftCost
from serving.spec_decode.grammar import constrain, row_masks
from serving.spec_decode.metrics import AcceptanceStats, depths_tried
from serving.spec_decode.tree import DraftTree
from serving.spec_decode.verify import verify_block, verify_greedy, verify_sampled
from serving.structured_output import mask_logits

EMPTY = DraftTree()


class Speculator:
    def __init__(self, engine, config: SpeculativeConfig):
        self.config = config
        self.scheduler, self.block_manager, self.runner = engine.scheduler, engine.block_manager, engine.runner
        self.ctx = DraftContext(engine.runner, engine.folder, engine.fingerprint, engine.scheduler.max_num_seqs,
                                engine.block_manager.enable_prefix_caching, compute=engine.compute)
        self.drafter = make_drafter(self.ctx, config)
        self.grammars = engine.grammars
        self.stats = AcceptanceStats(config.num_speculative_tokens)
        self.policy = (AdaptivePolicy(config, engine.step_cost, DraftCost(), per_request=not self.drafter.is_calibrated)
                       if config.adaptive else None)
        self.is_calibrated = False

    def calibrate(self, engine) -> None:
        """Times the drafter for the adaptive policy's cost model: short generations over random prompts, drafted to
        depth 1 and to the full depth for one request and to the full depth for several, after a warm-up (a
        drafter's first calls include one-time work). Once, on an idle engine with this speculator in use; what it
        generated is then forgotten."""
        policy, k = self.policy, self.config.num_speculative_tokens
        generator = torch.Generator().manual_seed(0)
        max_tokens = 6
        prompt_len = max(1, min(32, engine.max_model_len - max_tokens - k - 2))
        phases = ((1, k), (1, 1), (1, k), (min(4, self.scheduler.max_num_seqs), k))  # (requests, depth)
        for i, (num_requests, depth) in enumerate(phases):
            policy.forced_depth = depth
            prompts = [torch.randint(engine.model.config.vocab_size, (prompt_len,), generator=generator).tolist()
                       for _ in range(num_requests)]
            engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            if i == 0:
                policy.draft_cost = DraftCost()
        policy.forced_depth = None
        policy.chosen.clear()
        policy.timings.clear()
        self.stats = AcceptanceStats(k)
        self.block_manager.reset_prefix_cache()
        self.is_calibrated = True

    @staticmethod
    def can_speculate(request: Request) -> bool:
        """Whether a request's tokens can be drafted for exactly: its law at a row depends only on the target's
        logits there and, for structured outputs, on the grammar state of the row's path; penalties and biases
        (`needs_history`) decode plainly. Logprobs are read from the verified rows, the target's own."""
        return not request.params.needs_history

    def grammar_drafts(self, request: Request) -> bool:
        """Whether the tokens the request's grammar forces are drafted: the request and the config allow it."""
        return request.params.grammar_drafts and self.config.grammar_drafts

    # ---- 1. verify and roll back ----------------------------------------------------------------------

    def verify(self, request: Request, logits: torch.Tensor, best: list[int]) -> tuple[DraftTree, list[int], list[int]]:
        """logits: [1 + nodes, vocab] at the newest token and at each node of the request's tree; best: their
        argmaxes. Rolls the request back to its accepted tokens and returns (the tree, the accepted path, the tokens
        to emit). The accepted nodes' K/V move into the slots of their positions; lookahead rows are never accepted."""
        tree, request.spec.tree = request.spec.tree, DraftTree()
        if request.grammar is not None:
            logits = mask_logits(logits[:1 + len(tree)], row_masks(self.grammars, request.grammar, tree))
            best = logits.argmax(-1).tolist()
        if request.params.is_greedy:
            path, emitted = verify_greedy(tree, best)
        elif self.config.rejection_sample_method == "block" and tree.is_chain:
            path, emitted = verify_block(tree, target_probs(logits, request.params), request.generator)
        else:
            path, emitted = verify_sampled(tree, target_probs(logits, request.params), request.generator)
        newest = request.num_computed_tokens - 1 - tree.num_rows
        for depth, node in enumerate(path, start=1):
            if node != depth - 1:
                self.runner.move(request, newest + 1 + node, newest + depth)
        request.num_computed_tokens = newest + 1 + len(path)
        self.block_manager.trim(request, request.num_computed_tokens)
        return tree, path, emitted

    def record(self, request: Request, tree: DraftTree, path: list[int], num_emitted: int) -> None:
        if request.spec.stats is None:
            request.spec.stats = AcceptanceStats(self.config.num_speculative_tokens)
        request.spec.stats.record(tree, path, num_emitted)
        self.stats.record(tree, path, num_emitted)
        if self.policy:
            self.policy.record(request, depths_tried(tree, path), len(path), tree.depth)
            if tree.survivals:
                self.policy.record_survivals(tree, len(path))

    def record_invalid(self, request: Request, num_invalid: int) -> None:
        """Drafts the request's grammar forbade, cut before verification."""
        if request.spec.stats is None:
            request.spec.stats = AcceptanceStats(self.config.num_speculative_tokens)
        request.spec.stats.num_invalid_spec_tokens += num_invalid
        self.stats.num_invalid_spec_tokens += num_invalid

    def record_undrafted(self, request: Request, num_emitted: int) -> None:
        """A step in which the request carried no draft: `record` of an empty tree, without building one."""
        self.record(request, EMPTY, [], num_emitted)

    # ---- 2. observe -----------------------------------------------------------------------------------

    def observe(self, step: StepOutputs) -> None:
        """The drafter notes what the target kept this step (every request of the step, finishing ones included);
        the adaptive policy, what the step cost."""
        self.drafter.observe(dataclasses.replace(self.ctx, step=step))
        if self.policy:
            batch = step.batch
            has_prefill = any(n - tree > 1 for n, tree in zip(batch.num_scheduled, batch.num_tree_rows))
            self.policy.record_step(len(batch.input_ids), len(batch.requests), len(batch.logits_rows), step.elapsed_s,
                                    has_prefill)

    def registered(self, request: Request, first_block: int) -> None:
        """The prefix cache registered the request's blocks from `first_block` on (a pooled drafter keeps what they
        still need)."""
        self.drafter.registered(request, first_block)

    def reset(self, request: Request) -> None:
        """Forgets a request that finished, was preempted or aborted: its drafts, estimate and drafter state."""
        self.drafter.reset(request)
        request.spec.reset()

    # ---- 3. propose -----------------------------------------------------------------------------------

    def propose(self, step: StepOutputs) -> None:
        """Draft trees for every running request that has just emitted a token and can be speculated for, unless more
        than disable_by_batch_size requests are running; each as large as the config and the step's room allow, or as
        the adaptive policy chooses within that."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        ready = [r for r in self.scheduler.running
                 if r.num_computed_tokens == r.num_tokens - 1 and self.can_speculate(r)]
        budgets, room = self.budgets(ready)
        reserved = self.reserve(ready, budgets, room)
        requests = [r for r in ready if r.request_id in reserved]
        if not requests:
            return
        trees = self.draft(step, requests, budgets)
        for request in requests:
            budget, num_reserved = budgets[request.request_id], reserved[request.request_id]
            tree = trees.get(request.request_id, DraftTree()).prefix(budget.num_nodes, budget.depth)
            request.spec.tree = self.constrain(request, tree, budget, num_reserved)
            self.trim(request, num_reserved)

    def max_rows(self, request: Request) -> int:
        return self.config.max_draft_nodes + (self.config.num_speculative_tokens if self.grammar_drafts(request) else 0)

    def budgets(self, ready: list[Request]) -> tuple[dict[str, DraftBudget], dict[str, int]]:
        """(the budget of each ready request that drafts, every ready request's room)."""
        config = self.config
        room = self.scheduler.draft_room(ready, {r.request_id: self.max_rows(r) for r in ready}) if ready else {}
        caps = {}
        for request in ready:
            depth = min(config.num_speculative_tokens, request.params.max_tokens - request.num_output_tokens - 1)
            if room[request.request_id] > 0 and depth > 0:
                caps[request.request_id] = DraftBudget(min(room[request.request_id], config.max_draft_nodes), depth)
        if self.policy and caps:
            return self.policy.choose(self.scheduler, ready, caps, prior(self.stats)), room
        return caps, room

    def reserve(self, ready: list[Request], budgets: dict[str, DraftBudget], room: dict[str, int]) -> dict[str, int]:
        """Allocates each budgeted request's rows, in running order; returns the rows reserved per request. When the
        pool is overcommitted (someone will be preempted next step) a request gets no drafts."""
        reserved = {}
        for request in ready:
            budget = budgets.get(request.request_id)
            if not budget:
                continue
            num_rows = budget.num_nodes
            if self.grammar_drafts(request):
                num_rows = min(room[request.request_id], num_rows + budget.depth)
            if self.block_manager.allocate_slots(request, 1 + num_rows):
                reserved[request.request_id] = num_rows
        return reserved

    def draft(self, step: StepOutputs, requests: list[Request], budgets: dict[str, DraftBudget]) -> dict[str, DraftTree]:
        """The drafter's trees for `requests`, after its catch-up over their kept tokens. The drafting call's cost,
        what choosing depths changes, counts the catch-up too: only steps that draft pay it."""
        budgets = {r.request_id: budgets[r.request_id] for r in requests}
        ctx = dataclasses.replace(self.ctx, step=step)
        start = time.perf_counter()
        num_caught_up = self.drafter.catch_up(ctx, requests)
        drafting = time.perf_counter()
        trees = self.drafter.propose(ctx, requests, budgets)
        if self.policy:
            if num_caught_up:
                self.policy.draft_cost.add_catch_up(num_caught_up, drafting - start)
            self.policy.draft_cost.add(max(b.depth for b in budgets.values()), sum(b.num_nodes for b in budgets.values()),
                                       time.perf_counter() - drafting)
        return trees

    def constrain(self, request: Request, tree: DraftTree, budget: DraftBudget, num_reserved: int) -> DraftTree:
        """The tree cut to what the request's grammar allows, with the tokens it forces where those are drafted."""
        if request.grammar is None:
            return tree
        tree, num_invalid = constrain(self.grammars, request.grammar, tree, num_reserved, budget.depth,
                                      self.grammar_drafts(request))
        if num_invalid:
            self.record_invalid(request, num_invalid)
        return tree

    def trim(self, request: Request, num_reserved: int) -> None:
        """Gives back the reserved blocks past the request's tree."""
        if request.spec.tree.num_rows < num_reserved:
            self.block_manager.trim(request, request.num_tokens + request.spec.tree.num_rows)
