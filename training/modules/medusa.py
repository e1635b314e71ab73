"""Training Medusa heads (Cai et al. 2024, Medusa-1: heads on a frozen target).

Head i (0-based) reads h_t, the target's final hidden state after the final norm, and predicts x_{t+2+i}
(heads/medusa.py). Head i's loss is the token loss (losses.py; Medusa's cross-entropy against the target's own token
x_{t+2+i} by default, or a loss against the target's distribution of it, softmax(lm_head(h_{t+1+i}))), averaged over
the anchors whose label is an answer token (with prompt_loss, also the target's greedy token at a prompt token:
base.loss_labels), weighted by decay^i (Medusa's 0.8 by default) and summed over heads.
Heads are independent of one another, so the simulated chain reads every head at the same anchor: draft i+1 is
head i's argmax at t.
"""
from __future__ import annotations

import torch

from heads import Medusa
from training.modules.base import DraftModule
from training.modules.unroll import shift_left


class MedusaModule(DraftModule):
    kind = "medusa"
    default_loss = "ce"

    def __init__(self, num_heads: int = 4, num_layers: int = 1, own_lm_head: bool = False, decay: float = 0.8,
                 **kwargs):
        """Medusa heads and their loss.

        Args:
            num_heads: k heads; head i predicts x_{t+2+i}.
            num_layers: Residual blocks per head.
            own_lm_head: Give each head a trainable copy of the target's LM head.
            decay: Loss weight decay^i of head i.
        """
        super().__init__(**kwargs)
        if self.hparams.num_speculative_tokens > num_heads:
            raise ValueError(f"num_speculative_tokens={self.hparams.num_speculative_tokens} exceeds num_heads={num_heads}: "
                             "Medusa drafts one token per head; lower num_speculative_tokens or add heads")
        self.head = Medusa.from_target(self.target_parts, self.token_map_ids, num_heads=num_heads, num_layers=num_layers,
                                       own_lm_head=own_lm_head)

    def _heads(self, labels: torch.Tensor, has_label: torch.Tensor, hidden: dict):
        """(logits [K, N, vocab], labels [K, N], valid [K, N], anchors [B, S]) over anchors with any label;
        labels, has_label: [B, S]."""
        num_heads = self.head.config.num_heads
        valid = torch.stack([shift_left(has_label, 2 + i) for i in range(num_heads)])  # [K, B, S]
        labels = torch.stack([shift_left(labels, 2 + i) for i in range(num_heads)])  # [K, B, S]
        anchors = valid.any(0)  # [B, S]
        logits = self.head(hidden["last"][anchors])  # [K, N, vocab]
        return logits, labels[:, anchors], valid[:, anchors], anchors

    def _loss(self, logits, labels, valid, last, anchors) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head i, the token loss at the anchors whose label is valid; the target's distribution of x_{t+2+i} is
        lm_head(h_{t+1+i})."""
        rows, valid = self.draft_labels(labels, valid)
        per_head = []
        for i in range(logits.shape[0]):
            target_logprobs = None
            if self.draft_loss.needs_target:
                with torch.no_grad():
                    before = shift_left(last, 1 + i)[anchors][valid[i]]
                    target_logprobs = self.target_parts.lm_head(before).float().log_softmax(-1)
            row_loss = self.draft_loss(logits[i][valid[i]], target_logprobs, rows[i][valid[i]])
            per_head.append(row_loss.sum() / valid[i].sum().clamp(min=1))
        per_head = torch.stack(per_head)  # [K]
        weights = self.hparams.decay ** torch.arange(len(per_head), device=per_head.device)
        return (weights * per_head).sum(), per_head

    def training_loss(self, batch, hidden):
        logits, labels, valid, anchors = self._heads(*self.loss_labels(batch, hidden["last"]), hidden)
        loss, per_head = self._loss(logits, labels, valid, hidden["last"], anchors)
        right = (self.target_ids(logits.argmax(-1)) == labels) & valid
        accuracy = right.sum(-1) / valid.sum(-1).clamp(min=1)
        terms = {f"loss_{i + 1}": value for i, value in enumerate(per_head)}
        terms.update({f"acc_{i + 1}": value for i, value in enumerate(accuracy)})
        return loss, terms

    def validation_outputs(self, batch, hidden):
        logits, labels, valid, anchors = self._heads(batch["input_ids"], batch["loss_mask"], hidden)
        loss, _ = self._loss(logits, labels, valid, hidden["last"], anchors)
        k = self.hparams.num_speculative_tokens
        correct = torch.zeros(*anchors.shape, k, dtype=torch.bool, device=anchors.device)  # [B, S, k]
        is_valid = torch.zeros_like(correct)
        correct[anchors] = ((self.target_ids(logits.argmax(-1)) == labels) & valid)[:k].T
        is_valid[anchors] = valid[:k].T
        return loss, correct, is_valid, [logits[i][valid[i]] for i in range(k)]
