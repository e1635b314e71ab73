"""Training an EAGLE-3 layer (Li et al. 2025) with training-time test.

`fc` fuses the target's three aux layers at position t into g_t; the layer then runs `num_steps` unrolled steps
over its own outputs exactly as the engine drafts (unroll.py): step s reads (x_{t+s+1}, out^{s-1}_t) at position
t+s, attends to step 0's K/V at positions <= t and to its own unrolled K/V at t+1..t+s, and predicts x_{t+s+2}.

Step s's loss is the token loss (losses.py), weighted by decay^s (0.8 in EAGLE-3 and SpecForge). By default it is
the soft cross-entropy against the target's distribution of x_{t+s+2}, softmax(lm_head(h_{t+s+1})) renormalised over
the draft vocabulary (the same as a softmax over the draft vocabulary's logits), less that distribution's entropy:
KL(target || draft), the same gradient and zero at a perfect fit; `loss` picks CE against x_{t+s+2}, TV, the LK
hybrid or a mix instead. Anchors whose label x_{t+s+2} is no answer token, or lies outside the draft vocabulary,
are left out of the loss (the draft cannot be right there; SpecForge masks on the target's argmax, which for a
greedy store is that same token). With prompt_loss, prompt tokens are labels too, as the target's greedy token
among the draft vocabulary (base.loss_labels). The draft vocabulary is the store's `draft_vocab_size` most frequent
answer tokens (training/data/vocab.py), chosen when training starts; the head's `norm` and `lm_head` rows start
from the target's. The store must hold the aux layers the head fuses (by default both use 2, L//2, L-3) and the
last hidden state, which gives the target's distribution.
"""
from __future__ import annotations

import torch

from heads import Eagle3
from training.data.vocab import draft_vocab
from training.modules.base import DraftModule
from training.modules.unroll import shift_left, unroll


class FusedAuxModule(DraftModule):
    """What the kinds over EAGLE-3's body share (EAGLE-3, P-EAGLE): the aux layers the store must hold, and the draft
    vocabulary chosen from the store when training starts. Subclasses set `self.head`."""
    hidden_layers = ("last", "eagle3")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.has_draft_vocab = False

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.head.config.aux_layers)

    def use_store(self, store) -> None:
        if tuple(store.aux_layers) != self.aux_layers:
            raise ValueError(f"store {store.path} holds aux layers {list(store.aux_layers)} but this EAGLE-3 head fuses "
                             f"{list(self.aux_layers)}: set model.init_args.aux_layers: {list(store.aux_layers)}, or "
                             f"regenerate the store with --aux-layers {','.join(map(str, self.aux_layers))}")
        if not self.has_draft_vocab:  # a resumed run then loads the checkpoint's vocabulary over this one
            d2t, _ = draft_vocab(store, self.head.config.draft_vocab_size)
            self.head.set_draft_vocab(d2t + torch.arange(len(d2t)))
            self.head.init_from_target()
            self.has_draft_vocab = True

    def draft_rows(self) -> torch.Tensor:
        return self.target_parts.lm_head.weight[self.head.draft_token_ids]  # [draft_vocab, hidden]


class Eagle3Module(FusedAuxModule):
    kind = "eagle3"

    def __init__(self, num_steps: int = 7, decay: float = 0.8, draft_vocab_size: int = 32000,
                 aux_layers: list[int] | None = None, intermediate_size: int | None = None, norm_before_fc: bool = False,
                 fc_norm: bool = False, norm_output: bool = False, norm_before_residual: bool = False,
                 embed_requires_grad: bool = False, draft_window: int = 0, **kwargs):
        """An EAGLE-3 layer and its training-time test.

        Args:
            num_steps: Unrolled training-time-test steps.
            decay: Loss weight decay^s of step s.
            draft_vocab_size: Tokens the head drafts over: the store's most frequent answer tokens.
            aux_layers: The target layers whose inputs are fused (null: 2, L//2, L-3).
            intermediate_size: MLP width of the layer (null: the target's).
            norm_before_fc: EAGLE 3.1: one RMSNorm over the concatenated aux states before fc.
            fc_norm: EAGLE 3.1: one RMSNorm per aux state before fc (excludes norm_before_fc).
            norm_output: EAGLE 3.1: the layer's output is normed before it is fed back to the next step.
            norm_before_residual: hidden_norm(g), not g, is the layer's residual stream (speculators' default).
            embed_requires_grad: The head trains an embedding of its own, started from the target's (speculators'
                option of that name); false: it reads the target's, frozen.
            draft_window: The layer's sliding window in keys (0: full attention), in training as in serving.
        """
        super().__init__(**kwargs)
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1")
        self.head = Eagle3.from_target(self.target_parts, draft_vocab_size=draft_vocab_size,
                                       aux_layers=tuple(aux_layers or ()), intermediate_size=intermediate_size,
                                       norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=norm_output,
                                       norm_before_residual=norm_before_residual, own_embedding=embed_requires_grad,
                                       draft_window=draft_window)

    def _steps(self, batch: dict, hidden: dict, num_steps: int) -> list[torch.Tensor]:
        g = self.head.fuse(hidden["eagle3"])  # [B, S, hidden]
        return unroll(self.head, batch["input_ids"], g, batch["padding_mask"], num_steps,
                      self.head.config.max_position_embeddings, self.head.config.draft_window)

    def _loss(self, labels: torch.Tensor, has_label: torch.Tensor, last: torch.Tensor,
              outs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        draft_rows = self.draft_rows()
        draft_index = self.head.draft_index
        loss, terms = 0.0, {}
        for s, out in enumerate(outs):
            label = shift_left(labels, s + 2)  # [B, S]
            valid = shift_left(has_label, s + 2) & self.head.t2d[label]
            num = max(1, int(valid.sum()))
            logits = self.head.logits(out[valid]).float()  # [N, draft_vocab]
            target_logprobs = None
            if self.draft_loss.needs_target:
                with torch.no_grad():
                    target_logprobs = (shift_left(last, s + 1)[valid] @ draft_rows.to(last.dtype).T).float().log_softmax(-1)
            step_loss = self.draft_loss(logits, target_logprobs, draft_index[label[valid]]).sum() / num
            loss = loss + self.hparams.decay ** s * step_loss
            terms[f"loss_{s + 1}"] = step_loss
            terms[f"acc_{s + 1}"] = (self.head.to_target_ids(logits.argmax(-1)) == label[valid]).sum() / num
        return loss, terms

    def training_loss(self, batch, hidden):
        last = hidden["last"]
        labels = self.loss_labels(batch, last, self.draft_rows(), self.head.to_target_ids)
        return self._loss(*labels, last, self._steps(batch, hidden, self.hparams.num_steps))

    def validation_outputs(self, batch, hidden):
        k, num_steps = self.hparams.num_speculative_tokens, self.hparams.num_steps
        outs = self._steps(batch, hidden, max(k, num_steps))
        loss, _ = self._loss(batch["input_ids"], batch["loss_mask"], hidden["last"], outs[:num_steps])
        correct, valid, logits = self.chain_outcomes(batch, outs[:k], lambda s, rows: self.head.logits(rows),
                                                     self.head.to_target_ids)
        return loss, correct, valid, logits
