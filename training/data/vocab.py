"""An EAGLE-3 draft vocabulary from the target's own answers.

EAGLE-3 drafts over a smaller vocabulary than the target's: the tokens the target answers with most often.
Draft ids are those tokens sorted by target id, stored as EAGLE-3 and vLLM store them:
`d2t` [draft_vocab] int64 with target_id = draft_id + d2t[draft_id], and `t2d` [target_vocab] bool, true on
the target ids that have a draft id.
"""
from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import torch

from training.data.store import Store


def answer_token_counts(store: Store) -> torch.Tensor:
    """How often each target token occurs in the answers (loss_mask == 1): [target_vocab] int64."""
    vocab_size = store.meta["target"]["fingerprint"]["vocab_size"]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in store.table.with_format("arrow").iter(batch_size=1024):
        ids = pc.list_flatten(batch["input_ids"]).to_numpy()
        mask = pc.list_flatten(batch["loss_mask"]).to_numpy()
        counts += np.bincount(ids[mask == 1], minlength=vocab_size)
    return torch.from_numpy(counts)


def draft_vocab(store: Store, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64, t2d [target_vocab] bool) for the `size` most frequent answer tokens (ties to the lower
    id); when the answers hold fewer distinct tokens, the lowest unused target ids fill the rest."""
    counts = answer_token_counts(store).numpy()
    vocab_size = len(counts)
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must lie in [1, {vocab_size}] (the target's vocabulary)")
    ids = np.arange(vocab_size)
    by_frequency = np.lexsort((ids, -counts))
    chosen = by_frequency[:size][counts[by_frequency[:size]] > 0]
    fill = np.setdiff1d(ids, chosen)[: size - len(chosen)]  # sorted ascending
    target_ids = np.sort(np.concatenate([chosen, fill]))
    d2t = torch.from_numpy(target_ids - np.arange(size)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(target_ids)] = True
    return d2t, t2d
