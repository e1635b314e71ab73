"""Training a P-EAGLE head (Hui et al. 2026, arXiv 2602.01469): K drafts per forward (heads/peagle.py).

A batch [B, S] becomes one block per example: depth 0 at every position t (EAGLE-3's input, (x_{t+1}, fc(aux_t)) at
position t, predicting x_{t+2}), then placeholder elements (t, d) for d = 1..K-1 (the mask token and mask_hidden at
position t + d, predicting x_{t+d+2}), all in one forward of the layer with `heads.peagle.block_mask`: an element sees
the depth-0 elements at anchors <= its own and its own rollout (t, 1..d). That is what the engine's one drafting
forward computes at anchor t (the newest kept pair) for depths 1..K-1.

Which placeholders are trained is conditional drop-token (COD) sampling, as the paper and speculators do: depth 0
keeps every anchor whose label is an answer token in the draft vocabulary (n of them); depth d keeps
int((n - d) * max(r^d, r_min)) anchors drawn at random among those depth d - 1 kept whose depth-d label is valid too
(all of them when fewer), so a rollout is always (t, 1..d) and deeper depths cost geometrically fewer rows
(`down_sample_ratio` r = 0.7, `down_sample_ratio_min` r_min = 0.2 as speculators), drawn from a generator seeded by
the optimizer step (a resumed run draws what an uninterrupted one does). Validation keeps every rollout instead, so
val/acc_1..k, val/tau and val/tau_walk judge every anchor as the other kinds do.

The loss at depth d is the token loss (losses.py; by default the KL from the target's distribution of x_{t+d+2} over
the draft vocabulary to the head's, as Eagle3Module's), averaged over the depth's valid elements; the loss is the mean over depths, each depth weighing
the same whatever its number of elements (as speculators). With a Markov head (markov_rank > 0), depth d >= 1's logits
add its bias from the label of depth d - 1, which is the draft a chain has there whenever depth d is reached.
"""
from __future__ import annotations

import torch

from heads import Peagle
from heads.attention import sdpa_gqa
from heads.peagle import block_mask
from training.modules.eagle3 import FusedAuxModule
from training.modules.unroll import shift_left


def sample_rollouts(valid: torch.Tensor, down_sample_ratio: float, down_sample_ratio_min: float,
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """valid: [S, K] bool, the label of depth d at anchor t is valid (depth 0 defines the n anchors). Returns the
    anchors kept at depths 1, 2, ... (ascending; as many depths as have some), each a subset of the depth before."""
    num_valid = int(valid[:, 0].sum())
    kept = valid[:, 0].nonzero()[:, 0]
    rollouts = []
    for depth in range(1, valid.shape[1]):
        size = int((num_valid - depth) * max(down_sample_ratio ** depth, down_sample_ratio_min))
        eligible = kept[valid[kept, depth]]
        if size <= 0 or not len(eligible):
            break
        if len(eligible) > size:
            eligible = eligible[torch.randperm(len(eligible), generator=generator)[:size]].sort().values
        rollouts.append(eligible)
        kept = eligible
    return rollouts


class PeagleModule(FusedAuxModule):
    kind = "peagle"

    def __init__(self, num_depths: int = 4, down_sample_ratio: float = 0.7, down_sample_ratio_min: float = 0.2,
                 mask_token_id: int = 0, draft_vocab_size: int = 32000, aux_layers: list[int] | None = None,
                 intermediate_size: int | None = None, markov_rank: int = 0, norm_before_residual: bool = False,
                 embed_requires_grad: bool = False, draft_window: int = 0, **kwargs):
        """A P-EAGLE head: the EAGLE-3 body drafting num_depths tokens per forward.

        Args:
            num_depths: K, the depths trained together (depth 0 and K - 1 placeholder depths); serve at most this many
                drafts (num_speculative_tokens <= K).
            down_sample_ratio: COD sampling: depth d trains about n * r^d of the n answer anchors.
            down_sample_ratio_min: The fraction of anchors each depth keeps at least.
            mask_token_id: The token whose embedding the placeholder rows read (any fixed id of the vocabulary;
                speculators defaults to 0).
            draft_vocab_size: Tokens the head drafts over: the store's most frequent answer tokens.
            aux_layers: The target layers whose inputs are fused (null: 2, L//2, L-3).
            intermediate_size: MLP width of the layer (null: the target's).
            markov_rank: Rank of DSpark's Markov head on depths >= 1 (heads/peagle.py); 0: none.
            norm_before_residual: hidden_norm(g), not g, is the layer's residual stream (speculators' default).
            embed_requires_grad: The head trains an embedding of its own, started from the target's (speculators'
                option of that name, true by default for its P-EAGLE); false: it reads the target's, frozen.
            draft_window: The layer's sliding window in keys (0: full attention), in training as in serving.
        """
        super().__init__(**kwargs)
        if not 0 < down_sample_ratio <= 1 or not 0 <= down_sample_ratio_min <= 1:
            raise ValueError(f"down_sample_ratio={down_sample_ratio} must be in (0, 1] and down_sample_ratio_min="
                             f"{down_sample_ratio_min} in [0, 1]")
        self.head = Peagle.from_target(self.target_parts, draft_vocab_size=draft_vocab_size,
                                       aux_layers=tuple(aux_layers or ()), intermediate_size=intermediate_size,
                                       mask_token_id=mask_token_id, num_depths=num_depths, markov_rank=markov_rank,
                                       norm_before_residual=norm_before_residual, own_embedding=embed_requires_grad,
                                       draft_window=draft_window)

    def _valid(self, labels: torch.Tensor, has_label: torch.Tensor, num_depths: int) -> torch.Tensor:
        """[B, S, num_depths] bool: the label x_{t+d+2} of depth d at anchor t is one to train on."""
        return torch.stack([shift_left(has_label, d + 2) & self.head.t2d[shift_left(labels, d + 2)]
                            for d in range(num_depths)], dim=-1)

    def block(self, batch: dict, hidden: dict, rollouts: list[list[torch.Tensor]]):
        """One forward over every example's block: depth 0 at its S positions, then rollouts[b][d - 1] the anchors of
        depth d. Returns (out [B, N, hidden], anchors [B, N], depths [B, N], is_real [B, N])."""
        input_ids, padding_mask = batch["input_ids"], batch["padding_mask"]
        batch_size, num_positions = input_ids.shape
        device = input_ids.device
        anchors, depths = [], []
        for example in rollouts:
            anchors.append(torch.cat([torch.arange(num_positions, device=device), *example]))
            depths.append(torch.cat([torch.zeros(num_positions, dtype=torch.long, device=device),
                                     *(torch.full_like(a, d) for d, a in enumerate(example, start=1))]))
        num = max(map(len, anchors))
        is_real = torch.stack([torch.arange(num, device=device) < len(a) for a in anchors])  # [B, N]
        anchors = torch.stack([torch.cat([a, a.new_zeros(num - len(a))]) for a in anchors])
        depths = torch.stack([torch.cat([d, d.new_zeros(num - len(d))]) for d in depths])
        is_real[:, :num_positions] = padding_mask
        at_depth_0 = depths == 0
        ids = torch.where(at_depth_0, shift_left(input_ids, 1).gather(1, anchors), self.head.config.mask_token_id)
        g = self.head.fuse(hidden["eagle3"])  # [B, S, hidden]
        g = torch.where(at_depth_0[..., None], g.gather(1, anchors[..., None].expand(-1, -1, g.shape[-1])),
                        self.head.mask_feature().to(g.dtype))
        positions = (anchors + depths).clamp(max=self.head.config.max_position_embeddings - 1)
        mask = block_mask(anchors, depths, is_real, self.head.config.draft_window)
        out = self.head(ids, g, positions, lambda layer_idx, q, k, v: sdpa_gqa(q, k, v, mask))
        return out, anchors, depths, is_real

    def _loss(self, labels, has_label, last, out, anchors, depths, is_real) -> tuple[torch.Tensor, dict]:
        num_depths = self.head.config.num_depths
        num_positions = labels.shape[1]
        draft_rows = self.draft_rows()
        draft_index = self.head.draft_index
        label_at = anchors + depths + 2
        inside = is_real & (label_at < num_positions)
        label_at = label_at.clamp(max=num_positions - 1)
        label = labels.gather(1, label_at)
        previous = labels.gather(1, label_at - 1)  # the label of the depth before (the Markov head's token)
        valid = inside & has_label.gather(1, label_at) & self.head.t2d[label]
        loss, terms = 0.0, {}
        for d in range(num_depths):
            rows = valid & (depths == d)
            if d and not rows.any():
                continue
            num = max(1, int(rows.sum()))
            logits = self.head.depth_logits(out[rows], d, previous[rows]).float()  # [n, draft_vocab]
            target_logprobs = None
            if self.draft_loss.needs_target:
                with torch.no_grad():
                    before = last.gather(1, (label_at - 1)[..., None].expand(-1, -1, last.shape[-1]))[rows]
                    target_logprobs = (before @ draft_rows.to(last.dtype).T).float().log_softmax(-1)
            depth_loss = self.draft_loss(logits, target_logprobs, draft_index[label[rows]]).sum() / num
            loss = loss + depth_loss / num_depths
            terms[f"loss_{d + 1}"] = depth_loss
            terms[f"acc_{d + 1}"] = (self.head.to_target_ids(logits.argmax(-1)) == label[rows]).sum() / num
        return loss, terms

    def training_loss(self, batch, hidden):
        last = hidden["last"]
        labels, has_label = self.loss_labels(batch, last, self.draft_rows(), self.head.to_target_ids)
        valid = self._valid(labels, has_label & batch["padding_mask"], self.head.config.num_depths).cpu()
        p = self.hparams
        generator = torch.Generator().manual_seed(self.global_step)
        rollouts = [[a.to(labels.device) for a in sample_rollouts(v, p.down_sample_ratio, p.down_sample_ratio_min,
                                                                  generator)] for v in valid]
        return self._loss(labels, has_label, last, *self.block(batch, hidden, rollouts))

    def validation_outputs(self, batch, hidden):
        k, num_depths = self.hparams.num_speculative_tokens, self.head.config.num_depths
        num_blocks = max(k, num_depths)
        answer = batch["loss_mask"]
        # every anchor with an answer label at some depth, its rollout complete
        anchored = torch.stack([shift_left(answer, d + 2) for d in range(num_blocks)]).any(0)  # [B, S]
        rollouts = [[example.nonzero()[:, 0]] * (num_blocks - 1) for example in anchored]
        out, anchors, depths, is_real = self.block(batch, hidden, rollouts)
        loss, _ = self._loss(batch["input_ids"], answer, hidden["last"], out, anchors, depths, is_real)
        batch_size, num_positions = answer.shape
        outs = [out[:, :num_positions]]
        for d in range(1, k):
            at_depth = torch.zeros(batch_size, num_positions, out.shape[-1], dtype=out.dtype, device=out.device)
            rows = depths == d
            example = torch.arange(batch_size, device=out.device)[:, None].expand_as(depths)[rows]
            at_depth[example, anchors[rows]] = out[rows]
            outs.append(at_depth)
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]

        def depth_logits(s, rows):  # rows: depth s's outputs where chain_outcomes judges it; the token before: x_{t+s+1}
            return self.head.depth_logits(rows, s, shift_left(input_ids, s + 1)[shift_left(loss_mask, s + 2)])

        correct, valid, logits = self.chain_outcomes(batch, outs, depth_logits, self.head.to_target_ids)
        return loss, correct, valid, logits
