"""The model runner's view of one step: every scheduled token of every request flattened into one batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.attention import PagedMetadata
from serving.request import Request


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

    @classmethod
    def build(cls, scheduled: list[tuple[Request, int]], block_size: int, device) -> "Batch":
        """A request whose chunk reaches the end of its tokens needs logits for its last 1 + drafts rows
        (the target's next token after its last real token, and one per draft to verify)."""
        ids, positions, logits_rows, logits_start, token_start = [], [], [], [], []
        query_lens, context_lens, tables, num_leaves = [], [], [], []
        row = 0
        for request, num in scheduled:
            start = request.num_computed_tokens
            tokens = request.token_ids + request.spec_token_ids if request.spec_token_ids else request.token_ids
            ids.extend(tokens[start:start + num])
            leaves = request.spec_num_leaves  # the last drafts, each one position after the first row
            assert not leaves or start + num == len(tokens), "a step schedules all of a request's drafts or none"
            positions.extend(range(start, start + num - leaves))
            positions.extend([start + 1] * leaves)
            token_start.append(row)
            if start + num == len(tokens):
                num_logits = 1 + len(request.spec_token_ids)
                logits_start.append(len(logits_rows))
                logits_rows.extend(range(row + num - num_logits, row + num))
            else:
                logits_start.append(-1)
            query_lens.append(num - leaves)
            context_lens.append(start + num - leaves)
            tables.append(request.block_ids)
            num_leaves.append(leaves)
            row += num
        return cls(
            requests=[r for r, _ in scheduled],
            num_scheduled=[n for _, n in scheduled],
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            meta=PagedMetadata.build(query_lens, context_lens, tables, block_size, device, num_leaves),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
            logits_start=logits_start,
            token_start=token_start,
        )
