"""Training an EAGLE-1 layer (Li et al. 2024) on the target's own features.

At position t the layer reads (x_{t+1}, h_t), h_t the target's final hidden state after the final norm, and
regresses the next feature h_{t+1} (heads/eagle.py). The loss is EAGLE's:

    feature_weight * SmoothL1(out_t, h_{t+1})                    (mean over the hidden size; EAGLE's v_w = 1.0)
  + token_weight * KL(softmax(lm_head(h_{t+1})) || softmax(lm_head(out_t)))   (EAGLE's p_w = 0.1)

(the token term is `loss`, losses.py: KL by default, or CE against x_{t+2}, TV, the LK hybrid or a mix)

averaged over the anchors whose label x_{t+2} is an answer token (with prompt_loss, any token but the first:
base.loss_labels). With `num_unroll_steps` > 1 the layer is also trained as it drafts after its first draft
(training-time test, as EAGLE-3 and HASS do): unrolled over its own outputs with the engine's attention
(unroll.py), step s reads (x_{t+s+1}, out^{s-1}_t) and is scored the same way against h_{t+s+1} and x_{t+s+2},
weighted decay^s. The KL term is EAGLE's soft cross-entropy less the target distribution's entropy: the same
gradient, and zero at a perfect fit, so the logged loss shows how far the head is from the target rather than how
uncertain the target is. Input features get uniform noise U(-noise, +noise) during training. EAGLE's code draws
(U(0, 1) - 0.5) * 0.2 * 512 / T for a sequence of T tokens, i.e. U(-0.1, 0.1) at T = 512 and more for shorter
sequences; this version keeps the amplitude fixed (default 0.1, the paper's U(-0.1, 0.1)) whatever the length, or,
with `noise_length` N, scales it by N / T per example as that code does (noise 0.1, noise_length 512).
Noise is drawn from a generator seeded by the seed and the global step, so a resumed run draws the same noise.

Validation drafts as the engine does: the layer unrolled over its own predicted features (unroll.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from heads import Eagle
from training.modules.base import DraftModule
from training.modules.unroll import shift_left, unroll


class EagleModule(DraftModule):
    kind = "eagle"

    def __init__(self, feature_weight: float = 1.0, token_weight: float = 0.1, noise: float = 0.1,
                 noise_length: int | None = None, seed: int = 0, num_unroll_steps: int = 1, decay: float = 0.8,
                 fc_bias: bool = False, intermediate_size: int | None = None, draft_window: int = 0, **kwargs):
        """An EAGLE-1 layer and its loss.

        Args:
            feature_weight: Weight of the SmoothL1 regression of the next feature (EAGLE's v_w).
            token_weight: Weight of the soft cross-entropy against the target's distribution (EAGLE's p_w).
            noise: Amplitude of the uniform noise on input features while training (0 turns it off).
            noise_length: null keeps the amplitude fixed; N scales it by N / T for an example of T tokens, as
                EAGLE's code does (N = 512).
            seed: Seed of that noise.
            num_unroll_steps: Steps the layer is unrolled over its own outputs in training.
            decay: Loss weight decay^s of unrolled step s.
            fc_bias: Give the fusing fc a bias, as EAGLE's code does (off by default: vLLM's EAGLE-1 layer has
                none, and a head with one is refused for it).
            intermediate_size: MLP width of the layer (null: the target's).
            draft_window: The layer's sliding window in keys (0: full attention), in training as in serving.
        """
        super().__init__(**kwargs)
        if num_unroll_steps < 1:
            raise ValueError(f"num_unroll_steps={num_unroll_steps} must be >= 1")
        if noise_length is not None and noise_length < 1:
            raise ValueError(f"noise_length={noise_length} must be >= 1, or null for a fixed amplitude")
        self.head = Eagle.from_target(self.target_parts, self.token_map_ids, fc_bias=fc_bias,
                                      intermediate_size=intermediate_size, draft_window=draft_window)

    def _step_loss(self, labels: torch.Tensor, has_label: torch.Tensor, last: torch.Tensor, out: torch.Tensor,
                   s: int) -> dict[str, torch.Tensor]:
        """out: [B, S, hidden] unrolled step s's output, ~ h_{t+s+1} at anchor t; labels, has_label: [B, S]."""
        valid = shift_left(has_label, s + 2)  # [B, S] x_{t+s+2} is a label
        predicted, target = out[valid], shift_left(last, s + 1)[valid]  # [N, hidden]
        num = max(1, predicted.shape[0])
        feature = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1).sum() / num
        logits = self.head.logits(predicted).float()  # [N, vocab]
        target_logprobs = None
        if self.draft_loss.needs_target:
            with torch.no_grad():
                target_logprobs = self.target_parts.lm_head(target).float().log_softmax(-1)
        label = shift_left(labels, s + 2)[valid]
        rows, in_map = self.draft_labels(label, torch.ones_like(label, dtype=torch.bool))
        token = self.draft_loss(logits, target_logprobs, rows.masked_fill(~in_map, -1)).sum() / num
        accuracy = (self.target_ids(logits.argmax(-1)) == label).sum() / num
        p = self.hparams
        return {"loss": p.feature_weight * feature + p.token_weight * token, "feature_loss": feature,
                "token_loss": token, "acc": accuracy}

    def _loss(self, labels: torch.Tensor, has_label: torch.Tensor, last: torch.Tensor,
              outs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss, terms = 0.0, {}
        for s, out in enumerate(outs):
            step = self._step_loss(labels, has_label, last, out, s)
            loss = loss + self.hparams.decay ** s * step.pop("loss")
            suffix = f"_{s + 1}" if s else ""
            terms.update({f"{name}{suffix}": value for name, value in step.items() if name != "acc"})
            terms[f"acc_{s + 1}"] = step["acc"]
        return loss, terms

    def training_loss(self, batch, hidden):
        last = hidden["last"]  # [B, S, hidden]
        features = last
        if self.hparams.noise > 0:
            generator = torch.Generator(last.device).manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
            noise = torch.rand(last.shape, generator=generator, device=last.device, dtype=torch.float32)
            amplitude = self.hparams.noise
            if self.hparams.noise_length:  # EAGLE's code: N / T times as much for an example of T tokens
                lengths = batch["padding_mask"].sum(1).clamp(min=1).float()  # [B]
                amplitude = (amplitude * self.hparams.noise_length / lengths)[:, None, None]
            features = last + ((2 * noise - 1) * amplitude).to(last.dtype)
        outs = unroll(self.head, batch["input_ids"], features, batch["padding_mask"], self.hparams.num_unroll_steps,
                      self.head.config.max_position_embeddings, self.head.config.draft_window)
        return self._loss(*self.loss_labels(batch, last), last, outs)

    def validation_outputs(self, batch, hidden):
        last = hidden["last"]
        k = self.hparams.num_speculative_tokens
        outs = unroll(self.head, batch["input_ids"], last, batch["padding_mask"],
                      max(k, self.hparams.num_unroll_steps), self.head.config.max_position_embeddings,
                      self.head.config.draft_window)
        correct, valid, logits = self.chain_outcomes(batch, outs[:k],
                                                     lambda s, rows: self.head.logits(rows), self.target_ids)
        loss, _ = self._loss(batch["input_ids"], batch["loss_mask"], last, outs[:self.hparams.num_unroll_steps])
        return loss, correct, valid, logits
