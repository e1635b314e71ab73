"""One batched paged forward for drafters that run a model of the target's family over a K/V pool
addressed by the target's block tables."""
from __future__ import annotations

import torch

from serving.attention import PagedAttention, PagedMetadata
from serving.sampler import sample


def flatten(chunks, block_size: int, device: torch.device):
    """chunks: (token ids, position of the first, block table) per sequence ->
    (ids [num_tokens], positions [num_tokens], PagedMetadata, query lengths), on `device`."""
    ids, positions, query_lens, context_lens = [], [], [], []
    for tokens, start, _ in chunks:
        ids.extend(tokens)
        positions.extend(range(start, start + len(tokens)))
        query_lens.append(len(tokens))
        context_lens.append(start + len(tokens))
    meta = PagedMetadata.build(query_lens, context_lens, [table for _, _, table in chunks], block_size, device)
    return torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta, query_lens


def paged_forward(model, cache, block_size: int, chunks, num_layers=None):
    """chunks: (token ids, position of the first, block table) per sequence.
    Returns logits [num_chunks, vocab] at each chunk's last token."""
    ids, positions, meta, query_lens = flatten(chunks, block_size, cache.k.device)
    last_rows = torch.tensor(query_lens, device=cache.k.device).cumsum(0) - 1
    return model(ids, positions, PagedAttention(cache, meta), last_rows, num_layers=num_layers).logits


def pick(logits: torch.Tensor, temperature: float | None, generators: list) -> tuple[list[int], torch.Tensor | None]:
    """Greedy drafts, or sampled drafts with their distributions q when `temperature` is set (> 0)."""
    if not temperature:
        return logits.argmax(-1).tolist(), None
    probs = torch.softmax(logits / temperature, dim=-1)
    tokens = [sample(p, g) for p, g in zip(probs, generators)]
    return tokens, probs


def num_reusable(fed: list[int], start: int, tokens: list[int]) -> int:
    """How many leading tokens of `tokens` a drafter's pool still holds, when it holds every token before
    `start` and last fed the drafts `fed` from there: those drafts count while the target accepted them."""
    num = start
    while num - start < len(fed) and num < len(tokens) - 1 and tokens[num] == fed[num - start]:
        num += 1
    return num  # never past the newest token: its logits give the first draft
