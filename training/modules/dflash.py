"""Training DFlash (Chen et al. 2026; heads/dflash.py) on a frozen target.

Each training sequence gets `num_anchors` random anchors a among the positions whose next token is a label (an
answer token; with prompt_loss, also a prompt token: base.loss_labels), several blocks per sequence per batch. The
block of anchor a is [x_a, MASK x (B-1)] at positions a..a+B-1; it attends to the context strictly before its anchor
(the target's fused features at positions p < a, as K/V of every drafter layer) and to itself (the whole block, or
with `causal` the slots up to its own), never to another block: `block_mask`. This is what the engine serves, the
newest token x_a being the one the target has not run yet. Slot k (1..B-1) predicts x_{a+k}; its token loss
(losses.py; by default the cross-entropy against that token, as DFlash) is weighted exp(-(k-1)/gamma) (DFlash's decay: early slots decide acceptance), slot 0 is not
trained, and the loss is the weighted sum over the labels in reach divided by their number (as speculators'
DFlash loss).

Validation drafts a block at every position as the engine would after that position's token: the block anchored at
t+1 (context <= t) gives draft s+1 at anchor t from slot s+1, judged against x_{t+s+2} like every kind's chain
(val/acc_1..k, val/tau, val/tau_walk, the confidence temperatures). The store must hold the target layers the head
fuses (offline: as its EAGLE-3 aux layers), or the data module runs online and the target computes them.
"""
from __future__ import annotations

import torch

from heads import DFlash
from heads.attention import DenseContextAttention
from training.modules.base import DraftModule

VALIDATION_ANCHORS = 64  # blocks per forward in validation, which drafts one at every position


def block_mask(anchors: torch.Tensor, padding_mask: torch.Tensor, block_size: int, causal: bool) -> torch.Tensor:
    """anchors: [B, N]; padding_mask: [B, S] (True on real tokens) -> [B, N * block_size, S + N * block_size]: a row
    of block j sees the real positions before anchors[:, j] and the rows of block j (the ones up to its own when
    causal)."""
    batch, num_positions = padding_mask.shape
    num_rows = anchors.shape[1] * block_size
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, R]
    positions = torch.arange(num_positions, device=anchors.device)
    context = (positions[None, None] < row_anchor[..., None]) & padding_mask[:, None]  # [B, R, S]
    rows = torch.arange(num_rows, device=anchors.device)
    same_block = rows[:, None] // block_size == rows[None] // block_size  # [R, R]
    if causal:
        same_block &= rows[None] <= rows[:, None]
    return torch.cat([context, same_block.expand(batch, num_rows, num_rows)], dim=-1)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size] the loss weight of each slot: 0 for the anchor, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))


class DFlashModule(DraftModule):
    kind = "dflash"
    hidden_layers = ("last", "eagle3")
    default_loss = "ce"

    def __init__(self, num_layers: int = 1, block_size: int = 8, mask_token_id: int | None = None, causal: bool = False,
                 target_layers: list[int] | None = None, gamma: float = 4.0, num_anchors: int = 32,
                 intermediate_size: int | None = None, **kwargs):
        """DFlash's drafter and its loss.

        Args:
            num_layers: Drafter decoder layers (Qwen3-style, q/k norm).
            block_size: B: a block is the anchor and B - 1 masks, drafting up to B - 1 tokens per forward.
            mask_token_id: The token whose embedding (the target's, frozen) fills the mask slots: one the target never
                writes, e.g. a reserved special token.
            causal: Mask slots attend to the slots before them only (false: to the whole block, as DFlash).
            target_layers: Target layers whose inputs are fused (null: the store's aux layers, or z-lab's spacing,
                one per drafter layer, for a store without them). Offline they must be the store's aux layers.
            gamma: Slot k's loss weight is exp(-(k-1)/gamma).
            num_anchors: Blocks per training sequence per batch, at random label positions.
            intermediate_size: MLP width of the drafter layers (null: the target's).
        """
        super().__init__(**kwargs)
        if gamma <= 0 or num_anchors < 1:
            raise ValueError(f"gamma={gamma} must be > 0 and num_anchors={num_anchors} >= 1")
        self.head = self._new_head(tuple(target_layers or ()))
        if self.hparams.num_speculative_tokens > self.head.config.num_drafts:
            raise ValueError(f"num_speculative_tokens={self.hparams.num_speculative_tokens} exceeds the block's "
                             f"{self.head.config.num_drafts} drafts (block_size={block_size}): draft fewer or train "
                             "longer blocks")

    def _new_head(self, target_layers: tuple[int, ...]) -> DFlash:
        p = self.hparams
        return DFlash.from_target(self.target_parts, self.token_map_ids, num_layers=p.num_layers,
                                  block_size=p.block_size, mask_token_id=p.mask_token_id, causal=p.causal,
                                  target_layers=target_layers, intermediate_size=p.intermediate_size)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.head.config.target_layers)

    def use_store(self, store) -> None:
        """A head given no target_layers fuses the store's aux layers (online too, where the target computes them);
        given some, offline they must be the store's."""
        layers = tuple(store.aux_layers)
        if self.hparams.target_layers is None and layers and layers != self.aux_layers:
            self.head = self._new_head(layers)
        if "eagle3" not in store.layers or layers == self.aux_layers:
            return
        raise ValueError(f"store {store.path} holds the target layers {list(store.aux_layers)} but this DFlash head "
                         f"fuses {list(self.aux_layers)}: set model.init_args.target_layers: {list(store.aux_layers)} "
                         f"(or null), regenerate the store with --aux-layers {','.join(map(str, self.aux_layers))}, "
                         "or train online (data.mode: online)")

    def blocks(self, batch: dict, hidden: dict, anchors: torch.Tensor) -> torch.Tensor:
        """The drafter's outputs [B, N, block_size, hidden] for the blocks at `anchors` [B, N]."""
        c = self.head.config
        ids, padding = batch["input_ids"], batch["padding_mask"]
        num_positions = ids.shape[1]
        block_ids = self.head.block_ids(ids.gather(1, anchors.clamp(max=num_positions - 1)))  # [B, N, block]
        positions = (anchors[..., None] + torch.arange(c.block_size, device=ids.device)).clamp(
            max=c.max_position_embeddings - 1)
        context = (self.head.fuse(hidden["eagle3"]), torch.arange(num_positions, device=ids.device).expand_as(ids))
        mask = block_mask(anchors, padding, c.block_size, c.causal)
        out = self.head(block_ids.flatten(1), positions.flatten(1), DenseContextAttention(mask), context)
        return out.view(*anchors.shape, c.block_size, -1)

    def sample_anchors(self, has_label: torch.Tensor, generator: torch.Generator | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [B, N], is_anchor [B, N]): up to num_anchors distinct positions a >= 1 per sequence whose next
        token is a label, at random; the rest padding (is_anchor false)."""
        starts = torch.zeros_like(has_label)
        starts[:, 1:-1] = has_label[:, 2:]
        num = min(self.hparams.num_anchors, has_label.shape[1])
        scores = torch.rand(has_label.shape, generator=generator, device="cpu").to(has_label.device)
        scores = scores.masked_fill(~starts, -1.0)
        chosen, anchors = scores.topk(num, dim=1)
        return anchors, chosen >= 0

    def _loss(self, batch, hidden, labels, has_label, generator=None) -> tuple[torch.Tensor, dict]:
        block = self.head.config.block_size
        anchors, is_anchor = self.sample_anchors(has_label, generator)
        out = self.blocks(batch, hidden, anchors)  # [B, N, block, hidden]
        at = (anchors[..., None] + torch.arange(block, device=anchors.device)).clamp(max=labels.shape[1] - 1)
        slot_labels = labels.gather(1, at.flatten(1)).view(at.shape)  # [B, N, block]
        valid = has_label.gather(1, at.flatten(1)).view(at.shape) & is_anchor[..., None]
        valid &= anchors[..., None] + torch.arange(block, device=anchors.device) < labels.shape[1]
        valid[..., 0] = False  # the anchor is given, not drafted
        rows, valid = self.draft_labels(slot_labels, valid)
        logits = self.head.logits(out[valid]).float()  # [M, vocab]
        target_logprobs = None
        if self.draft_loss.needs_target:  # the target's distribution of x_{a+k}: its last hidden state at a+k-1
            with torch.no_grad():
                last = hidden["last"]
                before = last.gather(1, (at - 1).flatten(1)[..., None].expand(-1, -1, last.shape[-1]))
                target_logprobs = self.target_parts.lm_head(before.view(*at.shape, -1)[valid]).float().log_softmax(-1)
        ce = self.draft_loss(logits, target_logprobs, rows[valid])
        weights = slot_weights(block, self.hparams.gamma).to(ce.device)
        slots = torch.arange(block, device=ce.device).expand_as(valid)[valid]
        loss = (weights[slots] * ce).sum() / max(1, len(ce))
        right = logits.argmax(-1) == rows[valid]
        terms = {}
        for k in range(1, block):
            at_k = slots == k
            terms[f"loss_{k}"] = ce[at_k].sum() / max(1, int(at_k.sum()))
            terms[f"acc_{k}"] = right[at_k].sum() / max(1, int(at_k.sum()))
        return loss, terms

    def training_loss(self, batch, hidden):
        # anchors drawn from the step's own seed: the same for a batch however the run got there (resumed or not)
        generator = torch.Generator().manual_seed(self.global_step)
        return self._loss(batch, hidden, *self.loss_labels(batch, hidden["last"]), generator)

    def validation_outputs(self, batch, hidden):
        k = self.hparams.num_speculative_tokens
        loss, _ = self._loss(batch, hidden, batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
        batch_size, num_positions = batch["input_ids"].shape
        outs = torch.zeros(batch_size, num_positions, k, self.head.config.hidden_size, dtype=hidden["eagle3"].dtype,
                           device=batch["input_ids"].device)  # [B, S, k] slot s+1 of the block anchored at t+1
        for first in range(0, num_positions - 1, VALIDATION_ANCHORS):
            t = torch.arange(first, min(first + VALIDATION_ANCHORS, num_positions - 1), device=outs.device)
            out = self.blocks(batch, hidden, (t + 1).expand(batch_size, len(t)))
            outs[:, t] = out[:, :, 1:k + 1]
        correct, valid, logits = self.chain_outcomes(batch, [outs[:, :, s] for s in range(k)],
                                                     lambda s, rows: self.head.logits(rows), self.target_ids)
        return loss, correct, valid, logits

