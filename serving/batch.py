"""The model runner's view of one step: every scheduled token of every request flattened into one batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.attention import PagedMetadata
from serving.request import Request
from serving.spec_decode.tree import DraftTree


@dataclass
class Batch:
    requests: list[Request]
    num_scheduled: list[int]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: PagedMetadata
    logits_rows: torch.Tensor  # [num_logits_rows] rows of the flat batch whose logits are needed
    logits_start: list[int]  # per request: its first row in the logits, or -1 when its chunk ends mid-prompt
    token_start: list[int]  # per request: its first row in the flat batch
    num_tree_rows: list[int]  # per request: its draft tree's rows (nodes, then lookahead rows), the last of its chunk
    trees: list[DraftTree]  # per request: the tree it carried this step

    @classmethod
    def build(cls, scheduled: list[tuple[Request, int]], block_size: int, device) -> "Batch":
        """A request whose chunk reaches the end of its tokens needs logits for its last 1 + drafts rows (the
        target's next token after its last real token, and one per node of its draft tree). Node i of the tree
        computes in the slot after the real tokens and nodes 0 .. i - 1, at position (newest token's) + its depth,
        and sees the real tokens and its path (DESIGN.md, "Trees"). Lookahead rows follow the nodes, each in the next
        slot at its offset, seeing the real tokens and the lookahead rows it names; the logits of the last
        `num_outputs` of them follow the request's verify rows."""
        ids, positions, logits_rows, logits_start, token_start = [], [], [], [], []
        query_lens, context_lens, tables, tree_paths, num_tree_rows, trees = [], [], [], [], [], []
        row = 0
        for request, num in scheduled:
            start = request.num_computed_tokens
            tree = request.spec_tree
            lookahead = tree.lookahead
            rows = list(tree.tokens) + (list(lookahead.tokens) if lookahead else [])
            ids.extend((request.token_ids + rows)[start:start + num] if tree else request.token_ids[start:start + num])
            num_real = num - tree.num_rows if tree else num
            assert not tree or start + num_real == request.num_tokens, "a step schedules all of a request's drafts or none"
            context = start + num_real
            positions.extend(range(start, context))
            paths = []
            if tree:
                positions.extend(context - 1 + d for d in tree.depths)
                slot = lambda r: (request.block_ids[(context + r) // block_size] * block_size
                                  + (context + r) % block_size)
                paths = [[slot(n) for n in tree.path(i)] for i in range(len(tree))]
                if lookahead:
                    positions.extend(context - 1 + offset for offset in lookahead.offsets)
                    paths += [[slot(len(tree) + r) for r in seen] for seen in lookahead.sees]
            token_start.append(row)
            if context == request.num_tokens:
                logits_start.append(len(logits_rows))
                logits_rows.extend(range(row + num_real - 1, row + num_real + len(tree)))
                if lookahead:
                    logits_rows.extend(range(row + num - lookahead.num_outputs, row + num))
            else:
                logits_start.append(-1)
            query_lens.append(num_real)
            context_lens.append(context)
            tables.append(request.block_ids)
            tree_paths.append(paths)
            num_tree_rows.append(len(paths))
            trees.append(tree)
            row += num
        return cls(
            requests=[r for r, _ in scheduled],
            num_scheduled=[n for _, n in scheduled],
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            meta=PagedMetadata.build(query_lens, context_lens, tables, block_size, device, tree_paths),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
            logits_start=logits_start,
            token_start=token_start,
            num_tree_rows=num_tree_rows,
            trees=trees,
        )
