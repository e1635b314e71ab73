"""Training multi-token prediction modules (DeepSeek-V3, section 2.2) on a frozen target.

Module j reads h^j_t (h^0 the target's final hidden state after the final norm, h^{j+1} module j's output) and
x_{t+j+1} at position t, and predicts x_{t+j+2} (heads/mtp.py); each module attends causally over its own K/V.
The loss is the token loss of every prediction (losses.py; by default the cross-entropy against the target's own
token, or a loss against the target's distribution of it, softmax(lm_head(h_{t+i+1})) for x_{t+i+2}), over anchors
whose label is an answer token (with prompt_loss, also the target's greedy token at a prompt token: base.loss_labels), weighted per
predicted offset: loss_weights[i] weights the predictions of x_{t+i+2}.

The engine serves MTP heads with serve_mode "chain" (module j drafts token j + 1) or "reuse_first" (module 0
drafts every token, feeding its own output back at the next position, as vLLM and SGLang do with one module).
Module 0 can train for the latter too:
`num_unroll_steps` > 1 unrolls it over its own outputs with the engine's attention (unroll.py), step s predicting
x_{t+s+2} under loss_weights[s]. Validation simulates what the engine serves: module 0 unrolled under
"reuse_first", modules 0..k-1 in order under "chain".
"""
from __future__ import annotations

from functools import partial

import torch

from heads import Mtp
from heads.attention import DenseCausalAttention
from training.modules.base import DraftModule
from training.modules.unroll import shift_left, unroll


class MtpModule(DraftModule):
    kind = "mtp"
    default_loss = "ce"

    def __init__(self, depth: int = 1, serve_mode: str = "reuse_first", num_unroll_steps: int = 2,
                 loss_weights: tuple[float, ...] = (1.0, 0.8, 0.64, 0.512),
                 intermediate_size: int | None = None, draft_window: int = 0, **kwargs):
        """MTP modules and their loss.

        Args:
            depth: D modules.
            serve_mode: How the engine drafts: reuse_first (module 0 drafts every token) or chain (module j drafts
                token j + 1).
            num_unroll_steps: Steps module 0 is unrolled over its own outputs in training.
            loss_weights: loss_weights[i] weights the predictions of x_{t+i+2}.
            intermediate_size: MLP width of each module's decoder layer (null: the target's).
            draft_window: The modules' sliding window in keys (0: full attention), in training as in serving.
        """
        super().__init__(**kwargs)
        k = self.hparams.num_speculative_tokens
        if serve_mode == "chain" and k > depth:
            raise ValueError(f"num_speculative_tokens={k} exceeds depth={depth}: serve_mode 'chain' drafts one token per "
                             "module; lower num_speculative_tokens, add modules, or use serve_mode 'reuse_first'")
        if num_unroll_steps < 1:
            raise ValueError(f"num_unroll_steps={num_unroll_steps} must be >= 1")
        if len(loss_weights) < max(depth, num_unroll_steps):
            raise ValueError(f"loss_weights has {len(loss_weights)} entries, but depth={depth} and num_unroll_steps="
                             f"{num_unroll_steps} predict up to {max(depth, num_unroll_steps)} offsets: give one weight each")
        self.head = Mtp.from_target(self.target_parts, self.token_map_ids, depth=depth, serve_mode=serve_mode,
                                   intermediate_size=intermediate_size, draft_window=draft_window)

    def _predictions(self, batch: dict, hidden: dict, num_unroll_steps: int, depth: int) -> list[tuple[int, int, torch.Tensor]]:
        """(offset i, module j, output [B, S, hidden]) for module 0 unrolled num_unroll_steps steps, then modules
        1..depth-1 in order; the output predicts x_{t+i+2}."""
        ids, padding_mask = batch["input_ids"], batch["padding_mask"]
        window = self.head.config.draft_window
        outs = unroll(partial(self.head.forward_module, 0), ids, hidden["last"], padding_mask, num_unroll_steps,
                      self.head.config.max_position_embeddings, window)
        predictions = [(s, 0, out) for s, out in enumerate(outs)]
        features = outs[0]
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        for j in range(1, depth):
            features = self.head.forward_module(j, shift_left(ids, j + 1), features, positions,
                                                DenseCausalAttention(padding_mask, window))
            predictions.append((j, j, features))
        return predictions

    def _loss(self, labels: torch.Tensor, has_label: torch.Tensor, last: torch.Tensor,
              predictions) -> tuple[torch.Tensor, dict]:
        loss, terms = 0.0, {}
        for offset, module, out in predictions:
            label = shift_left(labels, offset + 2)  # [B, S]
            valid = shift_left(has_label, offset + 2)
            num = max(1, int(valid.sum()))
            logits = self.head.logits(module, out[valid]).float()  # [N, vocab]
            rows, in_map = self.draft_labels(label[valid], torch.ones_like(label[valid], dtype=torch.bool))
            target_logprobs = None
            if self.draft_loss.needs_target:
                with torch.no_grad():
                    target_logprobs = self.target_parts.lm_head(shift_left(last, offset + 1)[valid]).float().log_softmax(-1)
            prediction_loss = (self.draft_loss(logits, target_logprobs, rows) * in_map).sum() / num
            loss = loss + self.hparams.loss_weights[offset] * prediction_loss
            name = f"module{module + 1}_draft{offset + 1}"
            terms[f"loss_{name}"] = prediction_loss
            terms[f"acc_{name}"] = (self.target_ids(logits.argmax(-1)) == label[valid]).sum() / num
        return loss, terms

    def training_loss(self, batch, hidden):
        predictions = self._predictions(batch, hidden, self.hparams.num_unroll_steps, self.head.config.depth)
        return self._loss(*self.loss_labels(batch, hidden["last"]), hidden["last"], predictions)

    def validation_outputs(self, batch, hidden):
        k, num_unroll_steps, depth = self.hparams.num_speculative_tokens, self.hparams.num_unroll_steps, self.head.config.depth
        is_reuse = self.head.config.serve_mode == "reuse_first"
        predictions = self._predictions(batch, hidden, max(k, num_unroll_steps) if is_reuse else num_unroll_steps, depth)
        trained = [(i, j, out) for i, j, out in predictions if j > 0 or i < num_unroll_steps]
        loss, _ = self._loss(batch["input_ids"], batch["loss_mask"], hidden["last"], trained)
        served = [(j, out) for i, j, out in predictions if (j == 0 if is_reuse else j == i)][:k]
        modules = [j for j, _ in served]
        correct, valid, logits = self.chain_outcomes(batch, [out for _, out in served],
                                                     lambda s, rows: self.head.logits(modules[s], rows), self.target_ids)
        return loss, correct, valid, logits
