"""MTP heads as drafters, in either of their config's serve modes:
- 'chain' (MtpChainDrafter): module j (0-based) drafts token j + 1, as the modules were trained (DeepSeek-V3's
  multi-token prediction). A chain: module j reads module j - 1's output, so one path only.
- 'reuse_first' (MtpReuseFirstDrafter): module 0 drafts every token, as an EAGLE-1 layer does (drafters/eagle.py),
  trees included."""
from __future__ import annotations

import math

import torch

from serving.attention import KVCache, PagedAttention
from serving.drafters.base import Drafter
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.eagle import EagleDrafter
from serving.spec_decode.tree import DraftTree


class MtpReuseFirstDrafter(EagleDrafter):
    """MTP with serve_mode 'reuse_first': module 0 as an EAGLE-1 layer."""

    kinds = ("mtp_reuse_first",)

    def _forward(self, ids, features, positions, meta):
        return self.head.forward_module(0, ids, features, positions, PagedAttention(self.cache, meta))

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.logits(0, out)


class MtpChainDrafter(Drafter):
    """MTP with serve_mode 'chain': module j (0-based) drafts token j + 1, as the modules were trained.

    Module j at position t reads (h^j_t, x_{t+j+1}), so its K/V reaches position c - 1 - j with real tokens when
    the target has kept c tokens; drafting token j + 1 runs module j over positions c - j .. c - 1, whose inputs
    are the drafts before it and module j - 1's outputs there. Each step's catch-up rewrites those speculative
    entries, starting module j at c_before - j from module j - 1's output kept from the previous step.

    Its slot per request: module j -> (position, module j's output there), the last each module computed."""

    kinds = ("mtp",)
    needs_hidden = True
    is_calibrated = True

    @classmethod
    def check(cls, config, ctx, head=None):
        if config.topk > 1:
            raise ValueError(f"draft trees (topk > 1) apply to MTP heads with serve_mode 'reuse_first'; {config.model} has "
                             "serve_mode 'chain': set serve_mode 'reuse_first' in its config.json, or leave topk 1")
        if config.num_speculative_tokens > head.config.depth:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this MTP head's depth "
                             f"{head.config.depth} (serve_mode 'chain' drafts one token per module): draft fewer "
                             "tokens or set serve_mode 'reuse_first' in its config.json")

    @classmethod
    def build(cls, ctx, config, head=None, token_map=None):
        cls.check(config, ctx, head)
        return cls(ctx, head, token_map, config.confidence_threshold)

    def __init__(self, ctx, head, token_map=None, threshold=0.0):
        self.head, self.depth, self.confidence = head, head.config.depth, Confidence(head, threshold)
        self.token_map = token_map
        layer, runner = head.config.layer_config(), ctx.runner
        self.cache = KVCache(self.depth, runner.cache.num_blocks, runner.block_size, layer.num_kv_heads, layer.head_dim,
                             runner.dtype, runner.device, windows=(head.config.draft_window,) * self.depth)
        self.device = runner.device
        self.num_lookahead = self.depth  # module j's K/V at position p depends on token p + j + 1

    def last_outputs(self, request) -> dict[int, tuple[int, torch.Tensor]]:
        """The request's slot: module -> (position, its output there), made on first use."""
        return request.spec.slots.setdefault(self, {})

    def _run(self, ctx, j: int, chunks):
        """chunks: (token ids, first position, features [n, hidden], block table) -> outputs [n, hidden] each."""
        ids, positions, meta, query_lens = ctx.runner.flatten([(t, start, table) for t, start, _, table in chunks])
        out = self.head.forward_module(j, ids, torch.cat([f for _, _, f, _ in chunks]), positions,
                                       PagedAttention(self.cache, meta))
        return out.split(query_lens)

    @torch.inference_mode()
    def observe(self, ctx):
        step, kept = ctx.step, {}  # request id -> (request, c_before, c, first row)
        keep_finishing = ctx.enable_prefix_caching  # the blocks a finishing request registers
        for request in step.batch.requests:
            if not request.finish_reason or keep_finishing:
                rows, start = step.kept_rows(request)
                kept[request.request_id] = (request, start, start + len(rows), rows[0])
        previous = {}  # request id -> (first position, outputs) of module j - 1 this step
        carried_before = {rid: dict(self.last_outputs(request)) for rid, (request, *_) in kept.items()}  # as left before
        for j in range(self.depth):
            chunks, ranges = [], {}
            for rid, (request, c_before, c, first_row) in kept.items():
                high = c - 1 - j
                if j == 0:
                    low, features = c_before, step.out.hidden[first_row:first_row + c - c_before]
                elif rid in previous:
                    prev_low, prev_out = previous[rid]
                    low = max(c_before - j, 0)
                    carried = carried_before[rid].get(j - 1)
                    if low + 1 == prev_low and carried is not None and carried[0] == low:
                        features = torch.cat([carried[1][None], prev_out[:high - prev_low + 1]])
                    else:
                        low = prev_low
                        features = prev_out[:high - prev_low + 1]
                else:
                    continue
                if high < low:
                    continue
                chunks.append((request.token_ids[low + j + 1:high + j + 2], low, features, request.block_ids))
                ranges[rid] = low
            if not chunks:
                break
            for rid, out in zip(ranges, self._run(ctx, j, chunks)):
                previous[rid] = (ranges[rid], out)
                self.last_outputs(kept[rid][0])[j] = (ranges[rid] + len(out) - 1, out[-1])

    def _best(self, j: int, outputs: torch.Tensor) -> tuple[list[int], list[float]]:
        """(target ids of module j's most likely drafts after each output row, their log-probabilities)."""
        log_probs, best = top_log_probs(self.head.logits(j, outputs), 1, self.confidence.temperature(j + 1))
        ids = best[:, 0] if self.token_map is None else self.token_map[best[:, 0]]
        return ids.tolist(), log_probs[:, 0].tolist()

    @torch.inference_mode()
    def propose(self, ctx, requests, budgets):
        requests = [r for r in requests if 0 in self.last_outputs(r) and self.last_outputs(r)[0][0] == r.num_tokens - 2]
        if not requests:
            return {}
        first, log_probs = self._best(0, torch.stack([self.last_outputs(r)[0][1] for r in requests]))
        scores = {r.request_id: p for r, p in zip(requests, log_probs)}  # log chain probability
        survivals = {r.request_id: [math.exp(p)] for r, p in zip(requests, log_probs)}  # of each draft kept
        cuts = {r.request_id: self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests}
        drafts = {r.request_id: [token] for r, token in zip(requests, first) if scores[r.request_id] >= cuts[r.request_id]}
        requests = [r for r in requests if r.request_id in drafts]
        outputs = {r.request_id: torch.empty(0, self.head.config.hidden_size, dtype=ctx.runner.dtype, device=self.device)
                   for r in requests}
        for s in range(1, max((budgets[r.request_id].depth for r in requests), default=0)):
            active, chunks = [], []
            for r in requests:
                c, carried = r.num_tokens - 1, self.last_outputs(r).get(s - 1)
                if (budgets[r.request_id].depth <= s or len(drafts[r.request_id]) < s or carried is None
                        or carried[0] != c - s or not budgets[r.request_id].expands(s, scores[r.request_id])):
                    continue
                features = torch.cat([carried[1][None], outputs[r.request_id]])  # module s - 1 at c - s .. c - 1
                chunks.append((drafts[r.request_id][:s], c - s, features, r.block_ids))
                active.append(r)
            if not active:
                break
            outs = self._run(ctx, s, chunks)
            tokens, log_probs = self._best(s, torch.stack([o[-1] for o in outs]))
            for r, out, token, log_p in zip(active, outs, tokens, log_probs):
                scores[r.request_id] += log_p
                if scores[r.request_id] >= cuts[r.request_id]:
                    drafts[r.request_id].append(token)
                    survivals[r.request_id].append(math.exp(scores[r.request_id]))
                    outputs[r.request_id] = out
        kept = {rid: budgets[rid].num_kept(survivals[rid]) for rid in drafts}
        return {rid: DraftTree.chain(chain[:kept[rid]], survivals=survivals[rid][:kept[rid]]) for rid, chain in drafts.items()}
