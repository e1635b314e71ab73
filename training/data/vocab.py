"""An EAGLE-3 draft vocabulary from the target's own answers.

EAGLE-3 drafts over a smaller vocabulary than the target's: the tokens the target answers with most often.
Draft ids are those tokens sorted by target id, stored as EAGLE-3 and vLLM store them:
`d2t` [draft_vocab] int64 with target_id = draft_id + d2t[draft_id], and `t2d` [target_vocab] bool, true on
the target ids that have a draft id.

The same tokens make a token map (`draftheads token-map`) for heads that draft over the full vocabulary.
"""
from __future__ import annotations

from pathlib import Path

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


def frequent_tokens(store: Store, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties to the lower id), ascending: [size] int64. When the answers
    hold fewer distinct tokens, the lowest unused target ids fill the rest."""
    counts = answer_token_counts(store).numpy()
    vocab_size = len(counts)
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must lie in [1, {vocab_size}] (the target's vocabulary)")
    ids = np.arange(vocab_size)
    by_frequency = np.lexsort((ids, -counts))
    chosen = by_frequency[:size][counts[by_frequency[:size]] > 0]
    fill = np.setdiff1d(ids, chosen)[: size - len(chosen)]  # sorted ascending
    return torch.from_numpy(np.sort(np.concatenate([chosen, fill]))).to(torch.int64)


def draft_vocab(store: Store, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64, t2d [target_vocab] bool) over `frequent_tokens(store, size)`."""
    target_ids = frequent_tokens(store, size)
    t2d = torch.zeros(store.meta["target"]["fingerprint"]["vocab_size"], dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(size), t2d


def add_arguments(parser) -> None:
    parser.description = (
        "Write a token map: the store's most frequent answer tokens, as a 1-D int64 tensor saved with torch.save "
        "(the file SGLang's --speculative-token-map reads). Train a Medusa, EAGLE-1 or MTP head over it "
        "(--model.init_args.token_map PATH in `draftheads fit`; the head keeps it), or give it to a head trained "
        "without one in the engine ({\"token_map\": PATH} in the speculative config): the head then drafts among "
        "those tokens only, reading those rows of the LM head (FR-Spec).")
    parser.add_argument("--store", required=True, help="a store folder (`draftheads generate --out`)")
    parser.add_argument("--size", type=int, default=8192, help="tokens in the map")
    parser.add_argument("--out", required=True, help="the file to write, e.g. token_map.pt")


def run(args) -> None:
    ids = frequent_tokens(Store(args.store), args.size)
    write_token_map(ids, args.out)
    print(f"wrote {args.out}: {len(ids)} token ids")


def write_token_map(ids: torch.Tensor, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ids.to(torch.int64).contiguous(), tmp)
    tmp.replace(path)
