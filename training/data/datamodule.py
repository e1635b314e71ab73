"""The data module: batches of a self-distilled store for a draft head, offline or online.

offline  hidden states come from the store (memory-mapped, bf16); no target forward at all.
online   only token ids and loss masks come from the store; the LightningModule runs the frozen target
         (serving.model.Model) over each batch under no_grad, with dense causal attention per sequence, and
         rounds its hidden states to bf16 as the store holds them. Same batches, same loss, more compute and
         no hidden-state shards to read (e.g. to train on a store generated with other layers).

A batch is {input_ids [B, S] long, loss_mask [B, S] bool, padding_mask [B, S] bool (True on real tokens),
hidden: {layer: [B, S, width] bf16}} (hidden offline only), right-padded to its longest example. Examples are
batched with others of similar length: each epoch shuffles the examples with a generator seeded by (seed, epoch),
sorts pools of `num_pool_batches` batches by length, cuts them into batches and shuffles the batches. The train
loader saves its place in the epoch in checkpoints, so a run resumed mid-epoch sees the rest of that epoch's
batches. Under several processes each rank takes every world_size-th batch (so set use_distributed_sampler:
false in the Trainer) and validates every world_size-th held-out example. Validation reads the store's held-out
split (Store.split: by a hash of each example id).
"""
from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from serving import targets
from training.data.store import Store, tensor_keys

MODES = ("offline", "online")


class Examples(Dataset):
    """The store's examples cut to max_length tokens, with or without their hidden states."""

    def __init__(self, store: Store, max_length: int):
        self.store, self.max_length = store, max_length
        self.lengths = [min(length, max_length) for length in store.table["length"]]

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> dict:
        item = self.store[index]
        cut = slice(0, self.max_length)
        return {"input_ids": item["input_ids"][cut], "loss_mask": item["loss_mask"][cut].bool(),
                "hidden": {name: states[cut] for name, states in item["hidden"].items()}}


def pad_batch(items: list[dict]) -> dict:
    """Right-pads examples to the longest one: see the module docstring for the batch layout."""
    length = max(len(item["input_ids"]) for item in items)
    batch_size = len(items)
    input_ids = torch.zeros(batch_size, length, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, length, dtype=torch.bool)
    padding_mask = torch.zeros(batch_size, length, dtype=torch.bool)
    hidden = {name: states.new_zeros(batch_size, length, states.shape[-1]) for name, states in items[0]["hidden"].items()}
    for row, item in enumerate(items):
        num = len(item["input_ids"])
        input_ids[row, :num] = item["input_ids"]
        loss_mask[row, :num] = item["loss_mask"]
        padding_mask[row, :num] = True
        for name, states in item["hidden"].items():
            hidden[name][row, :num] = states
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "padding_mask": padding_mask}
    if hidden:
        batch["hidden"] = hidden
    return batch


class LengthBatches(Sampler[list[int]]):
    """Batches of examples of similar length, reshuffled per epoch from (seed, epoch), this rank's share only.
    `resume(epoch, num_seen)` makes the next pass over that epoch start after its first num_seen batches."""

    def __init__(self, lengths: list[int], batch_size: int, shuffle: bool, seed: int = 0, num_pool_batches: int = 64,
                 num_replicas: int = 1, rank: int = 0):
        self.lengths, self.batch_size, self.shuffle, self.seed = lengths, batch_size, shuffle, seed
        self.num_pool_batches, self.num_replicas, self.rank = num_pool_batches, num_replicas, rank
        self.epoch = 0
        # Lightning sets each epoch through `loader.sampler` and `loader.batch_sampler.sampler`, never on the batch
        # sampler itself: this makes the latter reach set_epoch.
        self.sampler = self
        self.num_skipped = 0  # batches of this epoch the current pass left out
        self._resume_at: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, num_seen: int) -> None:
        self._resume_at = (epoch, num_seen)

    def _batches(self) -> list[list[int]]:
        if not self.shuffle:  # validation: this rank's share of the examples, by length, so every rank has some
            share = sorted(range(self.rank, len(self.lengths), self.num_replicas), key=lambda i: self.lengths[i])
            if not share:
                raise ValueError(f"{len(self.lengths)} held-out examples cannot be shared by {self.num_replicas} "
                                 "processes: raise data.heldout_fraction or generate more examples")
            return [share[i:i + self.batch_size] for i in range(0, len(share), self.batch_size)]
        order = torch.arange(len(self.lengths))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = order[torch.randperm(len(order), generator=generator)]
        pool_size = self.num_pool_batches * self.batch_size
        batches = []
        for start in range(0, len(order), max(1, pool_size)):
            pool = sorted(order[start:start + pool_size].tolist(), key=lambda i: self.lengths[i])
            batches += [pool[i:i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        if len(batches) < self.num_replicas:
            raise ValueError(f"{len(batches)} training batches cannot be shared by {self.num_replicas} processes: "
                             "lower data.batch_size or train on more examples")
        batches = batches[:len(batches) - len(batches) % self.num_replicas]  # every rank steps as often
        # Global step k trains batches[k * world_size:(k + 1) * world_size], one per rank.
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        resume_at, self._resume_at = self._resume_at, None
        self.num_skipped = resume_at[1] if resume_at is not None and resume_at[0] == self.epoch else 0
        return iter(self._batches()[self.num_skipped:])

    def __len__(self) -> int:
        return len(self._batches())


class ResumableLoader(DataLoader):
    """A DataLoader over LengthBatches whose place in the epoch travels in Lightning's checkpoints (Lightning calls
    state_dict and load_state_dict on loaders that have them; DraftDataModule carries it too). Iterating starts at
    the first batch drawn, not at iter(), so a place loaded after Lightning's iter() still applies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_yielded = 0

    def __iter__(self):
        self.num_yielded = 0
        for batch in super().__iter__():
            self.num_yielded += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.batch_sampler.epoch, "num_batches": self.batch_sampler.num_skipped + self.num_yielded}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.resume(state["epoch"], state["num_batches"])


class DraftDataModule(LightningDataModule):
    def __init__(self, store: str, target: str = targets.DEFAULT_TARGET, mode: str = "offline", batch_size: int = 8,
                 max_length: int = 2048, heldout_fraction: float = 0.05, num_pool_batches: int = 64,
                 num_workers: int = 0, pin_memory: bool | None = None, seed: int = 0):
        """Batches of a store.

        Args:
            store: A store folder (`draftheads generate --out`).
            target: The target that generated it (the model's target, linked by the CLI).
            mode: offline (hidden states from the store) or online (the target computes them per batch).
            batch_size: Examples per batch.
            max_length: Tokens kept per example.
            heldout_fraction: Fraction of examples held out for validation.
            num_pool_batches: Batches per pool sorted by length.
            num_workers: Loader processes.
            pin_memory: null pins when CUDA is available.
            seed: Seed of the batch order.
        """
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown: choose offline (hidden states from the store) or online "
                             "(the target computes them per batch)")
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size must be >= 1 and max_length >= 2, got batch_size={batch_size}, "
                             f"max_length={max_length}")
        self.save_hyperparameters()
        self.mode = mode
        self.store: Store | None = None
        self.train_set = self.val_set = None
        self.train_loader: ResumableLoader | None = None
        self.train_position: dict | None = None  # a checkpoint's place in the epoch, for the next train loader

    def setup(self, stage: str) -> None:
        if self.store is not None:
            return
        p = self.hparams
        store = Store(p.store, targets.fingerprint(targets.resolve(p.target)))
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        needed = tuple(getattr(module, "hidden_layers", store.layers))
        missing = [layer for layer in needed if layer not in store.layers]
        if self.mode == "offline" and missing:
            raise ValueError(f"store {store.path} holds hidden states {list(store.layers)} but this head reads "
                             f"{list(needed)}: regenerate it with `draftheads generate --layers {','.join(needed)}`, "
                             "or train online (data.mode: online)")
        # Read only the layers the head needs (none online); Store reads every layer it lists.
        store.layers = needed if self.mode == "offline" else ()
        store.keys = tensor_keys(store.layers, store.aux_layers)
        train, heldout = store.split(p.heldout_fraction)
        if len(train) == 0 or len(heldout) == 0:
            raise ValueError(f"store {store.path} has {len(store)} examples: too few to hold some out for validation "
                             "(it needs at least 2); generate more with `draftheads generate`")
        self.store = store
        self.train_set, self.val_set = Examples(train, p.max_length), Examples(heldout, p.max_length)

    def _loader(self, dataset: Examples, shuffle: bool) -> DataLoader:
        p = self.hparams
        trainer = self.trainer
        batches = LengthBatches(dataset.lengths, p.batch_size, shuffle, p.seed, p.num_pool_batches,
                                trainer.world_size if trainer else 1, trainer.global_rank if trainer else 0)
        pin_memory = torch.cuda.is_available() if p.pin_memory is None else p.pin_memory
        loader = ResumableLoader if shuffle else DataLoader
        return loader(dataset, batch_sampler=batches, collate_fn=pad_batch, num_workers=p.num_workers,
                      pin_memory=pin_memory, persistent_workers=p.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        self.train_loader = self._loader(self.train_set, shuffle=True)
        if self.train_position is not None:
            self.train_loader.load_state_dict(self.train_position)
        return self.train_loader

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    # Lightning hands a loader its saved state only if it builds the loader after restoring the checkpoint's loops,
    # but under max_epochs configure_optimizers' trainer.estimated_stepping_batches builds it before: the resumed
    # epoch then started over at its first batch. The data module, restored before either, carries the place.
    def state_dict(self) -> dict:
        return {} if self.train_loader is None else {"train_position": self.train_loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.train_position = state.get("train_position")
        if self.train_loader is not None and self.train_position is not None:  # strategies that restore after setup
            self.train_loader.load_state_dict(self.train_position)
