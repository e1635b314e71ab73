"""The model runner: the only place a step's tensors are made. It flattens every scheduled token of every request
into one batch, builds the attention metadata (the one builder the drafters and the cost model use too), runs the
target's forward over the paged K/V pool, and returns the logits rows, the hidden rows and each logits row's argmax.
A target whose layers fall into several KV cache groups (sliding windows) has a pool per group and metadata per group
(each group's block tables), its layers attending through GroupedAttention."""
from __future__ import annotations

import array
import itertools
from dataclasses import dataclass

import torch

from serving.attention import GroupedAttention, KVCache, PagedAttention, PagedMetadata, kernel_attends
from serving.blocks import slot
from serving.kernels import argmax
from serving.model import Model, ModelOutput
from serving.request import Request
from serving.spec_decode.tree import DraftTree


@dataclass
class Batch:
    requests: list[Request]
    num_scheduled: list[int]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metas: list[PagedMetadata | None]  # per KV cache group
    logits_rows: torch.Tensor  # [num_logits_rows] rows of the flat batch whose logits are needed
    logits_start: list[int]  # per request: its first row in the logits, or -1 when its chunk ends mid-prompt
    token_start: list[int]  # per request: its first row in the flat batch
    num_tree_rows: list[int]  # per request: its draft tree's rows (nodes, then lookahead rows), the last of its chunk
    trees: list[DraftTree]  # per request: the tree it carried this step
    # per request asking for its prompt's logprobs: (its first row in the logits, past every other request's rows,
    # and the position of the first prompt token those rows predict); the rest of its chunk's rows before its last
    # prompt token follow. Empty unless a request asks.
    prompt_rows: dict[int, tuple[int, int]]


@dataclass
class RunOutput:
    """What the target's forward over one batch computed."""
    batch: Batch
    out: ModelOutput  # logits [num_logits_rows, vocab]; hidden and aux rows [num_tokens, hidden] when asked
    argmax: list[int]  # each logits row's most likely token


class ModelRunner:
    def __init__(self, model: Model, caches: list[KVCache], block_size: int, dtype: torch.dtype, device: torch.device,
                 layer_groups: tuple[tuple[int, int], ...] = ()):
        """caches: one pool per KV cache group, the full-attention group's first (serving.attention.kv_cache_groups);
        layer_groups: each layer's (group, index within the group), when there are several."""
        self.model, self.caches, self.block_size, self.dtype, self.device = model, caches, block_size, dtype, device
        self.cache = caches[0]  # the full-attention group's pool: the one drafters size theirs by
        self.layer_groups = layer_groups
        # prefill chunks attended row by row as decode steps are, where the C kernel attends: a row's bits then do
        # not depend on the chunk it is computed in (PagedMetadata.build)
        self.batch_every_query = kernel_attends(self.cache)

    def attention(self, metas: list[PagedMetadata]):
        """The target's attention over its pools, given each group's metadata."""
        if len(self.caches) == 1:
            return PagedAttention(self.cache, metas[0])
        return GroupedAttention([PagedAttention(c, m) if len(c.k) else None for c, m in zip(self.caches, metas)],
                                self.layer_groups)

    def move(self, request: Request, source: int, target: int) -> None:
        """Copies the K/V of the request's position `source` into position `target`, in every group's pool."""
        for cache, table in zip(self.caches, request.block_tables):
            cache.move(table, source, target)

    def metadata(self, query_lens, context_lens, block_tables, tree_paths=None) -> PagedMetadata:
        """The attention metadata of one flat forward (serving.attention.PagedMetadata.build: what each argument
        means), for this pool's block size, on this device."""
        return PagedMetadata.build(query_lens, context_lens, block_tables, self.block_size, self.device, tree_paths,
                                   self.batch_every_query)

    def flatten(self, chunks):
        """chunks: (token ids, position of the first, block table) per sequence ->
        (ids [num_tokens], positions [num_tokens], PagedMetadata, query lengths)."""
        ids, positions, query_lens, context_lens = [], [], [], []
        for tokens, start, _ in chunks:
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
        meta = self.metadata(query_lens, context_lens, [table for _, _, table in chunks])
        ids, positions = self.host_longs(ids, positions)
        return ids, positions, meta, query_lens

    def forward_chunks(self, model: Model, cache: KVCache, chunks, num_layers=None) -> torch.Tensor:
        """A model of the target's family (the target itself, a draft model) over `cache`, addressed by the
        target's block tables. chunks: (token ids, position of the first, block table) per sequence. Returns logits
        [num_chunks, vocab] at each chunk's last token."""
        ids, positions, meta, query_lens = self.flatten(chunks)
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return model(ids, positions, PagedAttention(cache, meta), last_rows, num_layers=num_layers).logits

    def forward_target_chunks(self, chunks, num_layers=None) -> torch.Tensor:
        """forward_chunks of the target over its own pools: chunks (token ids, position of the first, request)."""
        ids, positions, meta, query_lens = self.flatten([(tokens, start, r.block_ids) for tokens, start, r in chunks])
        context_lens = [start + len(tokens) for tokens, start, _ in chunks]
        metas = [meta] + [self.metadata(query_lens, context_lens, [r.block_tables[g] for _, _, r in chunks])
                          for g in range(1, len(self.caches))]
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model(ids, positions, self.attention(metas), last_rows, num_layers=num_layers).logits

    def build_batch(self, scheduled: list[tuple[Request, int]]) -> Batch:
        """A request whose chunk reaches the end of its tokens needs logits for its last 1 + drafts rows (the
        target's next token after its last real token, and one per node of its draft tree). Node i of the tree
        computes in the slot after the real tokens and nodes 0 .. i - 1, at position (newest token's) + its depth,
        and sees the real tokens and its path (docs/design.md, "Trees"). Lookahead rows follow the nodes, each in the next
        slot at its offset, seeing the real tokens and the lookahead rows it names; the logits of the last
        `num_outputs` of them follow the request's verify rows."""
        ids, positions, logits_rows, logits_start, token_start = [], [], [], [], []
        num_groups = len(self.caches)
        query_lens, context_lens, num_tree_rows, trees = [], [], [], []
        tables, tree_paths = [[] for _ in range(num_groups)], [[] for _ in range(num_groups)]  # per group
        prompt_rows, prompt_logits_rows = {}, []
        row = 0
        for i, (request, num) in enumerate(scheduled):
            start = request.num_computed_tokens
            tree = request.spec.tree
            lookahead = tree.lookahead
            rows = list(tree.tokens) + (list(lookahead.tokens) if lookahead else [])
            ids.extend((request.token_ids + rows)[start:start + num] if tree else request.token_ids[start:start + num])
            num_real = num - tree.num_rows if tree else num
            assert not tree or start + num_real == request.num_tokens, "a step schedules all of a request's drafts or none"
            context = start + num_real
            positions.extend(range(start, context))
            rows_seen = []  # per tree row, the rows after the context it sees, its own last
            if tree:
                positions.extend(context - 1 + d for d in tree.depths)
                rows_seen = [tree.path(i) for i in range(len(tree))]
                if lookahead:
                    positions.extend(context - 1 + offset for offset in lookahead.offsets)
                    rows_seen += [[len(tree) + r for r in seen] for seen in lookahead.sees]
            for table, group_paths, group_tables in zip(request.block_tables, tree_paths, tables):
                group_paths.append([[slot(table, context + r, self.block_size) for r in seen] for seen in rows_seen])
                group_tables.append(table)
            token_start.append(row)
            # the rows before the last prompt token predict prompt tokens start + 1 .. (the last one samples)
            predicting = range(start, min(context, request.num_prompt_tokens - 1))
            if request.params.prompt_logprobs is not None and predicting:
                prompt_rows[i] = (len(prompt_logits_rows), start + 1)
                prompt_logits_rows.extend(row + p - start for p in predicting)
            if context == request.num_tokens:
                logits_start.append(len(logits_rows))
                logits_rows.extend(range(row + num_real - 1, row + num_real + len(tree)))
                if lookahead:
                    logits_rows.extend(range(row + num - lookahead.num_outputs, row + num))
            else:
                logits_start.append(-1)
            query_lens.append(num_real)
            context_lens.append(context)
            num_tree_rows.append(len(rows_seen))
            trees.append(tree)
            row += num
        prompt_rows = {i: (len(logits_rows) + first, token) for i, (first, token) in prompt_rows.items()}
        logits_rows.extend(prompt_logits_rows)
        input_ids, positions, logits_rows = self.host_longs(ids, positions, logits_rows)
        return Batch(
            requests=[r for r, _ in scheduled],
            num_scheduled=[n for _, n in scheduled],
            input_ids=input_ids,
            positions=positions,
            metas=[self.metadata(query_lens, context_lens, t, p) if len(c.k) else None  # a group of no target layer
                   for c, t, p in zip(self.caches, tables, tree_paths)],
            logits_rows=logits_rows,
            logits_start=logits_start,
            token_start=token_start,
            num_tree_rows=num_tree_rows,
            trees=trees,
            prompt_rows=prompt_rows,
        )

    def host_longs(self, *lists: list[int]) -> list[torch.Tensor]:
        """Each list as an int64 tensor on the device, the lists through one buffer: after a forward has streamed the
        weights through the caches, each torch.tensor of a step's few ints cost tens of microseconds. The first list
        is never empty (a step schedules a token at least)."""
        host = torch.frombuffer(array.array("q", [v for values in lists for v in values]), dtype=torch.long)
        if self.device.type != "cpu":
            host = host.to(self.device)
        ends = list(itertools.accumulate(map(len, lists), initial=0))
        return [host[a:b] for a, b in zip(ends, ends[1:])]

    def run(self, scheduled: list[tuple[Request, int]], return_hidden: bool, aux_layers=()) -> RunOutput:
        """One flattened forward of the target over the scheduled tokens; the argmax of every logits row in one call."""
        batch = self.build_batch(scheduled)
        # forward itself, not nn.Module's call: the step's first Python after the forward's weights streamed through
        # the caches pays for every cache line it touches, and the call's hook checks touch some
        out = self.model.forward(batch.input_ids, batch.positions, self.attention(batch.metas), batch.logits_rows,
                         return_hidden=return_hidden, aux_layers=aux_layers)
        tokens = out.argmax if out.argmax is not None else argmax(out.logits) if out.logits is not None else []
        return RunOutput(batch, out, tokens)
