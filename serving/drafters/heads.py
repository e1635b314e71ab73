"""Drafters for trained heads (Medusa, EAGLE-1, EAGLE-3, MTP): loading a head folder against the engine's target.

Medusa reads the target's hidden state of the newest computed token and needs no K/V. EAGLE-1, EAGLE-3 and
MTP run a decoder layer of their own over a pool with the target's block count and block size, addressed by
the target's block tables. Every step they catch up over the tokens the target computed and kept in that
step (reading the target's hidden rows of the verify pass), then draft one token per batched forward,
feeding their own output back as the next feature.
"""
from __future__ import annotations

import torch

import heads
from heads.token_map import lm_head_rows, load_token_map
from serving.attention import KVCache, PagedAttention
from serving.drafters.runner import flatten
from serving.kernels import PackedLinear, for_inference


def make_head_drafter(engine, config):
    head = heads.load(config.model, engine.fingerprint)
    parts = heads.load_target_parts(engine.folder, fingerprint=engine.fingerprint, weights=False)
    weight_dtype = getattr(torch, config.draft_weights or "bfloat16")
    hot = head.token_map
    if config.token_map:
        given = load_token_map(config.token_map, parts.vocab_size)
        if hot is not None and not torch.equal(given, hot):
            raise ValueError(f"{config.model} drafts among the {len(hot)} tokens of the token map it was trained over, "
                             f"and {config.token_map} is another map: drop token_map from the speculative config (a "
                             "head keeps its own map)")
        if getattr(head.config, "own_lm_head", False) and hot is None:
            raise ValueError(f"{config.model} is a Medusa head with LM heads of its own over the whole vocabulary: a "
                             "token_map applies to heads that read the target's LM head; train it with the map instead")
        hot = given
    if hot is not None:
        hot = hot.to(engine.device)
        lm_head = PackedLinear(lm_head_rows(engine.model.lm_head, hot), weight_dtype)
    else:
        lm_head = engine.model.packed_lm_head(weight_dtype)
    parts.embed, parts.norm, parts.lm_head = engine.model.embed, engine.model.norm, lm_head
    head = head.bind_target(parts).to(engine.device, engine.dtype).eval().requires_grad_(False)
    head = for_inference(head, weight_dtype)
    kind = head.config.kind
    if kind != config.method:
        raise ValueError(f"{config.model} holds a head of kind {kind!r}, but the speculative config says method {config.method!r}: "
                         f"use \"method\": \"{kind}\"")
    if kind == "medusa":
        if config.num_speculative_tokens > head.config.num_heads:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this Medusa head's "
                             f"{head.config.num_heads} heads")
        return MedusaDrafter(head, hot, config.confidence_threshold, config.first_draft_topk)
    if kind == "mtp" and head.config.serve_mode == "chain":
        if config.first_draft_topk > 1:
            raise ValueError(f"first_draft_topk applies to MTP heads with serve_mode 'reuse_first'; {config.model} has "
                             "serve_mode 'chain': set serve_mode 'reuse_first' in its config.json, or leave first_draft_topk 1")
        if config.num_speculative_tokens > head.config.depth:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this MTP head's depth "
                             f"{head.config.depth} (serve_mode 'chain' drafts one token per module): draft fewer "
                             "tokens or set serve_mode 'reuse_first' in its config.json")
        return MtpChainDrafter(engine, head, hot, config.confidence_threshold)
    return FeatureDrafter(engine, head, hot, config.confidence_threshold, config.first_draft_topk)


def _best(logits: torch.Tensor, hot: torch.Tensor | None, temperature: float | None = None, to_ids=None) -> tuple[list, list]:
    """(target ids of the most likely drafts, the head's probability of each at `temperature`, or ones without
    one). With a token map the logits cover only its tokens; `to_ids` maps other reduced vocabularies (EAGLE-3's)."""
    best = logits.argmax(-1)
    ids = to_ids(best) if to_ids is not None else best if hot is None else hot[best]
    if temperature is None:
        return ids.tolist(), [1.0] * len(best)
    return ids.tolist(), log_confidence(logits, temperature).exp().tolist()


def ranked_after_best(logits: torch.Tensor, hot: torch.Tensor | None, num: int, temperature: float | None,
                      to_ids=None) -> tuple[list[list[int]], list[list[float]] | None]:
    """Per row of logits: the target ids of the `num` most likely drafts after the best, and their probabilities
    at `temperature` (None without one)."""
    top = logits.topk(1 + num, dim=-1).indices[:, 1:]
    ids = (to_ids(top) if to_ids is not None else top if hot is None else hot[top]).tolist()
    if temperature is None:
        return ids, None
    return ids, torch.softmax(logits.float() / temperature, dim=-1).gather(-1, top).tolist()


def _runners_up(logits: torch.Tensor, hot: torch.Tensor | None, num: int, temperature: float | None, threshold: float,
                to_ids=None) -> list[list[int]]:
    """Per row of logits: the `num` drafts after the best whose probability at `temperature` reaches `threshold`
    (all of them without a threshold): the leaves beside a chain's first draft."""
    if num == 0:
        return [[] for _ in range(len(logits))]
    ids, probs = ranked_after_best(logits, hot, num, temperature if threshold > 0 else None, to_ids)
    if probs is None:
        return ids
    return [[token for token, p in zip(row, row_probs) if p >= threshold] for row, row_probs in zip(ids, probs)]


def log_confidence(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(argmax) under softmax(logits / temperature), without materialising the softmax: [..., vocab] -> [...].
    The one definition the cut reads and training calibrates against."""
    shifted = logits.float() - logits.amax(-1, keepdim=True).float()
    return -torch.logsumexp(shifted / temperature, dim=-1)


class ChainCut:
    """Where a chain ends under `confidence_threshold`: before the first draft whose chain probability, the product
    of the head's probabilities of the drafts so far at its fitted temperatures (its estimate that the target
    accepts them all), falls below the threshold. A draft pays when that estimate exceeds what verifying and
    drafting one more token costs as a share of a step."""

    def __init__(self, head, threshold: float):
        self.threshold = threshold
        self.temperatures = list(head.config.confidence_temperatures)

    def temperature(self, position: int) -> float | None:
        """T of draft `position` (0-based); None when no cut is set, so that no probability is computed."""
        if self.threshold <= 0:
            return None
        return self.temperatures[position] if position < len(self.temperatures) else 1.0

    def keeps(self, chain_p: float, p: float) -> tuple[float, bool]:
        """(the chain probability with a draft of probability p added, whether the chain keeps that draft)."""
        chain_p *= p
        return chain_p, chain_p >= self.threshold


class MedusaDrafter:
    def __init__(self, head, hot=None, threshold=0.0, topk=1):
        self.head, self.hot, self.cut, self.num_leaves = head, hot, ChainCut(head, threshold), topk - 1
        self.aux_layers = ()
        self.draft_probs = {}
        self.leaves = {}  # request id -> the leaves beside its chain's first draft, this step

    @torch.inference_mode()
    def propose(self, engine, requests, budgets, step):
        self.leaves = {}
        requests = [r for r in requests if r.request_id in step.index]
        if not requests:
            return {}
        rows = [step.kept_rows(r)[0][-1] for r in requests]
        hidden = step.out.hidden[torch.tensor(rows, device=step.out.hidden.device)]
        logits = self.head(hidden)  # [num_heads, requests, vocab]
        drafted = [_best(logits[i], self.hot, self.cut.temperature(i))
                   for i in range(max(budgets[r.request_id] for r in requests))]  # (ids, probs) per head
        leaves = _runners_up(logits[0], self.hot, self.num_leaves, self.cut.temperature(0), self.cut.threshold)
        drafts = {}
        for n, r in enumerate(requests):
            chain, chain_p = [], 1.0
            for tokens, probs in drafted[:budgets[r.request_id]]:
                chain_p, ok = self.cut.keeps(chain_p, probs[n])
                if not ok:
                    break
                chain.append(tokens[n])
            drafts[r.request_id] = chain
            if chain and leaves[n]:
                self.leaves[r.request_id] = leaves[n]
        return drafts

    def reset(self, request):
        pass


class FeatureDrafter:
    """EAGLE-1, EAGLE-3 and MTP with serve_mode 'reuse_first' (module 0 drafts every token). Stateless between
    steps: the pool is rewritten from each step's kept tokens, so rollback and preemption need nothing."""

    def __init__(self, engine, head, hot=None, threshold=0.0, topk=1):
        self.head, self.kind, self.hot, self.cut = head, head.config.kind, hot, ChainCut(head, threshold)
        self.num_leaves = topk - 1
        self.leaves = {}  # request id -> the leaves beside its chain's first draft, this step
        layer = head.config.layer_config()
        self.cache = KVCache(1, engine.cache.num_blocks, engine.block_size, layer.num_kv_heads, layer.head_dim, engine.dtype,
                             engine.device)
        self.block_size, self.device = engine.block_size, engine.device
        self.num_lookahead = 1  # its K/V at position p depends on token p + 1
        self.aux_layers = tuple(head.config.aux_layers) if self.kind == "eagle3" else ()
        self.draft_probs = {}
        self.newest: dict[str, torch.Tensor] = {}

    def _features(self, step, rows: torch.Tensor) -> torch.Tensor:
        if self.kind == "eagle3":
            return self.head.fuse([step.out.aux[layer][rows] for layer in self.aux_layers])
        return step.out.hidden[rows]

    def _forward(self, ids, features, positions, meta):
        attention = PagedAttention(self.cache, meta)
        if self.kind == "mtp":
            return self.head.forward_module(0, ids, features, positions, attention)
        return self.head(ids, features, positions, attention)

    def _tokens(self, out: torch.Tensor, position: int) -> tuple[list[int], list[float], list[list[int]]]:
        """(each row's draft, its probability, and at the first position the leaves beside it)."""
        temperature = self.cut.temperature(position)
        if self.kind == "mtp":
            logits, hot, to_ids = self.head.logits(0, out), self.hot, None
        elif self.kind == "eagle3":
            logits, hot, to_ids = self.head.logits(out), None, self.head.to_target_ids
        else:
            logits, hot, to_ids = self.head.logits(out), self.hot, None
        num_leaves = self.num_leaves if position == 0 else 0
        return (*_best(logits, hot, temperature, to_ids),
                _runners_up(logits, hot, num_leaves, temperature, self.cut.threshold, to_ids))

    @torch.inference_mode()
    def observe(self, engine, step):
        """Catch up over every token the target computed and kept this step: the pair (h_p, x_{p+1}) at
        position p. Keeps each request's newest output, which its first draft reads."""
        chunks, rows, last = [], [], {}
        for request in step.batch.requests:
            if request.is_finished:
                continue
            kept, start = step.kept_rows(request)
            chunks.append((request.token_ids[start + 1:start + 1 + len(kept)], start, request.block_ids))
            rows.extend(kept)
            last[request.request_id] = len(rows) - 1
        self.newest = {}
        if not chunks:
            return
        ids, positions, meta, _ = flatten(chunks, self.block_size, self.device)
        out = self._forward(ids, self._features(step, torch.tensor(rows, device=self.device)), positions, meta)
        self.newest = {rid: out[row] for rid, row in last.items()}  # [hidden] each

    @torch.inference_mode()
    def propose(self, engine, requests, budgets, step):
        self.leaves = {}
        requests = [r for r in requests if r.request_id in self.newest]
        if not requests:
            return {}
        features = torch.stack([self.newest[r.request_id] for r in requests])  # [requests, hidden]
        drafts = {r.request_id: [] for r in requests}
        active = list(range(len(requests)))
        chain_p = [1.0] * len(requests)
        for s in range(max(budgets[r.request_id] for r in requests)):
            tokens, probs, leaves = self._tokens(features, s)
            kept = []
            for n, token, p, request_leaves in zip(active, tokens, probs, leaves):
                chain_p[n], ok = self.cut.keeps(chain_p[n], p)
                if ok:
                    drafts[requests[n].request_id].append(token)
                    if request_leaves:
                        self.leaves[requests[n].request_id] = request_leaves
                kept.append(ok)
            still = [j for j, n in enumerate(active) if kept[j] and budgets[requests[n].request_id] > s + 1]
            if not still:
                break
            features = features[torch.tensor(still, device=self.device)]
            active = [active[j] for j in still]
            step_requests = [requests[n] for n in active]
            # The draft just made is the input at position num_tokens - 1 + s.
            ids, positions, meta, _ = flatten([([drafts[r.request_id][-1]], r.num_tokens - 1 + s, r.block_ids)
                                               for r in step_requests], self.block_size, self.device)
            features = self._forward(ids, features, positions, meta)
        return drafts

    def reset(self, request):
        pass


class MtpChainDrafter:
    """MTP with serve_mode 'chain': module j (0-based) drafts token j + 1, as the modules were trained.

    Module j at position t reads (h^j_t, x_{t+j+1}), so its K/V reaches position c - 1 - j with real tokens when
    the target has kept c tokens; drafting token j + 1 runs module j over positions c - j .. c - 1, whose inputs
    are the drafts before it and module j - 1's outputs there. Each step's catch-up rewrites those speculative
    entries, starting module j at c_before - j from module j - 1's output kept from the previous step."""

    def __init__(self, engine, head, hot=None, threshold=0.0):
        self.head, self.depth, self.hot, self.cut = head, head.config.depth, hot, ChainCut(head, threshold)
        layer = head.config.layer_config()
        self.cache = KVCache(self.depth, engine.cache.num_blocks, engine.block_size, layer.num_kv_heads, layer.head_dim,
                             engine.dtype, engine.device)
        self.block_size, self.device = engine.block_size, engine.device
        self.num_lookahead = self.depth  # module j's K/V at position p depends on token p + j + 1
        self.aux_layers = ()
        self.draft_probs = {}
        self.carry: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}  # request id -> module -> (position, output)

    def _run(self, j: int, chunks):
        """chunks: (token ids, first position, features [n, hidden], block table) -> outputs [n, hidden] each."""
        ids, positions, meta, query_lens = flatten([(t, start, table) for t, start, _, table in chunks], self.block_size,
                                                   self.device)
        out = self.head.forward_module(j, ids, torch.cat([f for _, _, f, _ in chunks]), positions,
                                       PagedAttention(self.cache, meta))
        return out.split(query_lens)

    @torch.inference_mode()
    def observe(self, engine, step):
        kept = {}  # request id -> (request, c_before, c, first row)
        for request in step.batch.requests:
            if not request.is_finished:
                rows, start = step.kept_rows(request)
                kept[request.request_id] = (request, start, start + len(rows), rows[0])
        previous = {}  # request id -> (first position, outputs) of module j - 1 this step
        carried_before = {rid: dict(self.carry.get(rid, {})) for rid in kept}  # as the previous step left them
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
            for rid, out in zip(ranges, self._run(j, chunks)):
                previous[rid] = (ranges[rid], out)
                self.carry.setdefault(rid, {})[j] = (ranges[rid] + len(out) - 1, out[-1])

    @torch.inference_mode()
    def propose(self, engine, requests, budgets, step):
        requests = [r for r in requests if 0 in self.carry.get(r.request_id, {})
                    and self.carry[r.request_id][0][0] == r.num_tokens - 2]
        if not requests:
            return {}
        first, probs = _best(self.head.logits(0, torch.stack([self.carry[r.request_id][0][1] for r in requests])),
                             self.hot, self.cut.temperature(0))
        chain_p = {r.request_id: self.cut.keeps(1.0, p) for r, p in zip(requests, probs)}  # -> (chain p, kept)
        drafts = {r.request_id: [token] for r, token in zip(requests, first) if chain_p[r.request_id][1]}
        requests = [r for r in requests if r.request_id in drafts]
        if not requests:
            return drafts
        outputs = {r.request_id: torch.empty(0, self.head.config.hidden_size, dtype=engine.dtype, device=self.device)
                   for r in requests}
        for s in range(1, max(budgets[r.request_id] for r in requests)):
            active, chunks = [], []
            for r in requests:
                c, carried = r.num_tokens - 1, self.carry[r.request_id].get(s - 1)
                if budgets[r.request_id] <= s or len(drafts[r.request_id]) < s or carried is None or carried[0] != c - s:
                    continue
                features = torch.cat([carried[1][None], outputs[r.request_id]])  # module s - 1 at c - s .. c - 1
                chunks.append((drafts[r.request_id][:s], c - s, features, r.block_ids))
                active.append(r)
            if not active:
                break
            outs = self._run(s, chunks)
            tokens, probs = _best(self.head.logits(s, torch.stack([o[-1] for o in outs])), self.hot,
                                  self.cut.temperature(s))
            for r, out, token, p in zip(active, outs, tokens, probs):
                chain_p[r.request_id] = self.cut.keeps(chain_p[r.request_id][0], p)
                if chain_p[r.request_id][1]:
                    drafts[r.request_id].append(token)
                    outputs[r.request_id] = out
        return drafts

    def reset(self, request):
        self.carry.pop(request.request_id, None)
