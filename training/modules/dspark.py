"""Training DSpark (heads/dspark.py) on a frozen target: DFlash's blocks (training/modules/dflash.py: random anchors,
each block attending to the context before its anchor and to itself) with the Markov head's bias on every draft's
logits and the confidence head's loss beside the token loss, as speculators' `dspark` trains them.

Draft j of the block anchored at a (x_{a+j}, from slot `draft_slot(j)`) reads the Markov embedding of the true
x_{a+j-1} (teacher forcing: the anchor for j = 1); its token loss (losses.py; cross-entropy by default, as DFlash's
here) is weighted exp(-(j-1)/gamma). The confidence head learns, by binary cross-entropy on its logit, the draft's
acceptance rate under speculative sampling, 1 - TV(p, q) = sum_v min(p_v, q_v) with q the drafted distribution
(Markov bias included) and p the target's, detached, weighted as the token loss and scaled by `confidence_weight`
(speculators' confidence_head_alpha). The loss is the weighted sum over the labels in reach divided by their number.

Validation drafts a block at every position as DFlash's does; draft s+1 at anchor t reads the Markov embedding of
x_{t+s+1}, which is what the engine's chain conditions on whenever drafts 1..s were right, the only case the
simulated chain (val/tau_walk) scores draft s+1 in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from heads import DSpark
from training.modules.dflash import VALIDATION_ANCHORS, DFlashModule
from training.modules.unroll import shift_left


class DSparkModule(DFlashModule):
    kind = "dspark"

    def __init__(self, markov_rank: int = 256, sample_from_anchor: bool = True, confidence_head: bool = True,
                 confidence_with_markov: bool = True, confidence_weight: float = 1.0, **kwargs):
        """DSpark's drafter and its losses; every DFlash setting applies (but causal, which DSpark does not serve).

        Args:
            markov_rank: Rank of the Markov head's transition bias (speculators' default 256).
            sample_from_anchor: Slot k drafts x_{a+k+1}, the block drafting block_size tokens (speculators' and vLLM's
                default); false keeps DFlash's slots (slot k drafts x_{a+k}, block_size - 1 drafts).
            confidence_head: Train the per-draft acceptance estimate the engine's adaptive policy reads.
            confidence_with_markov: The confidence head also reads the previous token's Markov embedding.
            confidence_weight: Weight of the confidence head's loss beside the token loss.
        """
        if confidence_weight < 0:
            raise ValueError(f"confidence_weight={confidence_weight} must be >= 0")
        super().__init__(**kwargs)

    def _new_head(self, target_layers: tuple[int, ...]) -> DSpark:
        p = self.hparams
        return DSpark.from_target(self.target_parts, self.token_map_ids, num_layers=p.num_layers,
                                  block_size=p.block_size, mask_token_id=p.mask_token_id, causal=p.causal,
                                  target_layers=target_layers, intermediate_size=p.intermediate_size,
                                  markov_rank=p.markov_rank, sample_from_anchor=p.sample_from_anchor,
                                  confidence_head=p.confidence_head, confidence_with_markov=p.confidence_with_markov)

    def start_from_kind(self, saved, where: str) -> None:
        """A trained DFlash head warm-starts the backbone (heads/dspark.py, `warm_start`)."""
        if saved.config.kind != "dflash":
            super().start_from_kind(saved, where)
        try:
            self.head.warm_start(saved)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def _loss(self, batch, hidden, labels, has_label, generator=None) -> tuple[torch.Tensor, dict]:
        c = self.head.config
        ids, num_positions = batch["input_ids"], labels.shape[1]
        anchors, is_anchor = self.sample_anchors(has_label, generator)
        out = self.blocks(batch, hidden, anchors)[:, :, self.head.draft_slots]  # [B, N, D, hidden]
        j = torch.arange(1, c.num_drafts + 1, device=anchors.device)
        at = anchors[..., None] + j  # the drafted tokens' positions [B, N, D]
        inside = at < num_positions
        at = at.clamp(max=num_positions - 1)
        draft_labels = labels.gather(1, at.flatten(1)).view(at.shape)
        valid = has_label.gather(1, at.flatten(1)).view(at.shape) & is_anchor[..., None] & inside
        rows, valid = self.draft_labels(draft_labels, valid)
        previous = ids.gather(1, (at - 1).flatten(1)).view(at.shape)  # x_{a+j-1}, the anchor for j = 1
        embed = self.head.markov_embed(previous[valid])
        logits = self.head.markov_logits(out[valid], embed).float()  # [M, rows]
        target_logprobs = None
        if self.draft_loss.needs_target or self.head.confidence is not None:
            with torch.no_grad():  # the target's distribution of x_{a+j}: its last hidden state at a+j-1
                last = hidden["last"]
                before = last.gather(1, (at - 1).flatten(1)[..., None].expand(-1, -1, last.shape[-1]))
                target_logprobs = self.target_parts.lm_head(before.view(*at.shape, -1)[valid]).float().log_softmax(-1)
        token_loss = self.draft_loss(logits, target_logprobs, rows[valid])
        drafts = j.expand_as(valid)[valid]
        weights = torch.exp(-(drafts - 1) / self.hparams.gamma).to(token_loss.dtype)
        count = max(1, len(token_loss))
        loss = (weights * token_loss).sum() / count
        right = logits.argmax(-1) == rows[valid]
        terms = {}
        if self.head.confidence is not None:
            with torch.no_grad():
                accept = torch.minimum(logits.softmax(-1), target_logprobs.exp()).sum(-1)  # 1 - TV(p, q)
            confidence = self.head.confidence_logit(out[valid], embed).float()
            bce = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
            loss = loss + self.hparams.confidence_weight * (weights * bce).sum() / count
            terms["confidence_error"] = (confidence.sigmoid() - accept).abs().sum() / count
        for k in range(1, c.num_drafts + 1):
            at_k = drafts == k
            terms[f"loss_{k}"] = token_loss[at_k].sum() / max(1, int(at_k.sum()))
            terms[f"acc_{k}"] = right[at_k].sum() / max(1, int(at_k.sum()))
        return loss, terms

    def validation_outputs(self, batch, hidden):
        k, c = self.hparams.num_speculative_tokens, self.head.config
        loss, _ = self._loss(batch, hidden, batch["input_ids"], batch["loss_mask"], torch.Generator().manual_seed(0))
        ids = batch["input_ids"]
        batch_size, num_positions = ids.shape
        slots = [c.draft_slot(s + 1) for s in range(k)]
        outs = torch.zeros(batch_size, num_positions, k, c.hidden_size, dtype=hidden["eagle3"].dtype,
                           device=ids.device)  # [B, S, k] draft s+1 of the block anchored at t+1
        for first in range(0, num_positions - 1, VALIDATION_ANCHORS):
            t = torch.arange(first, min(first + VALIDATION_ANCHORS, num_positions - 1), device=outs.device)
            outs[:, t] = self.blocks(batch, hidden, (t + 1).expand(batch_size, len(t)))[:, :, slots]
        # draft s+1 at anchor t follows x_{t+s+1}
        embeds = [self.head.markov_embed(shift_left(ids, s + 1)).to(outs.dtype) for s in range(k)]
        size = c.hidden_size
        correct, valid, logits = self.chain_outcomes(
            batch, [torch.cat([outs[:, :, s], embeds[s]], -1) for s in range(k)],
            lambda s, rows: self.head.markov_logits(rows[:, :size], rows[:, size:]), self.target_ids)
        return loss, correct, valid, logits
