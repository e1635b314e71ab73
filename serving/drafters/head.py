"""Trained heads (Medusa, EAGLE-1, EAGLE-3, MTP, P-EAGLE, DFlash) as drafters: loading a head folder against the
engine's target, and the head's calibrated confidence that every head drafter scores its drafts with.

Medusa (drafters/medusa.py) reads the target's hidden state of the newest computed token and needs no K/V. EAGLE-1,
EAGLE-3, MTP and P-EAGLE (drafters/eagle.py, drafters/mtp.py, drafters/peagle.py) run a decoder layer of their own
over a pool with the target's block size, addressed by the target's block tables; DFlash (drafters/dflash.py) keeps
its layers' context K/V there.
"""
from __future__ import annotations

import math

import torch

import heads
from heads.token_map import lm_head_rows, load_token_map
from serving.kernels import PackedLinear, for_inference


def make_head_drafter(ctx, config):
    runner = ctx.runner
    head = heads.load(config.model, ctx.fingerprint)
    parts = heads.load_target_parts(ctx.target, fingerprint=ctx.fingerprint, weights=False)
    weight_dtype = getattr(torch, config.draft_weights or "bfloat16")
    token_map = head.token_map
    if config.token_map:
        given = load_token_map(config.token_map, parts.vocab_size)
        if token_map is not None and not torch.equal(given, token_map):
            raise ValueError(f"{config.model} drafts among the {len(token_map)} tokens of the token map it was trained over, "
                             f"and {config.token_map} is another map: drop token_map from the speculative config (a "
                             "head keeps its own map)")
        if head.config.kind == "medusa" and head.config.own_lm_head and token_map is None:
            raise ValueError(f"{config.model} is a Medusa head with LM heads of its own over the whole vocabulary: a "
                             "token_map applies to heads that read the target's LM head; train it with the map instead")
        token_map = given
    model = runner.model
    if token_map is not None:
        token_map = token_map.to(runner.device)
        lm_head = PackedLinear(lm_head_rows(model.lm_head, token_map), weight_dtype)
    else:
        lm_head = model.packed_lm_head(weight_dtype)
    parts.embed, parts.norm, parts.lm_head = model.embed, model.norm, lm_head
    head = head.bind_target(parts).to(runner.device, runner.dtype).eval().requires_grad_(False)
    head = for_inference(head, weight_dtype)
    kind = head.config.kind
    if kind != config.method:
        raise ValueError(f"{config.model} holds a head of kind {kind!r}, but the speculative config says method {config.method!r}: "
                         f"use \"method\": \"{kind}\"")
    if kind == "medusa":
        from serving.drafters.medusa import MedusaDrafter

        if config.num_speculative_tokens > head.config.num_heads:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this Medusa head's "
                             f"{head.config.num_heads} heads")
        return MedusaDrafter(head, token_map, config)
    if kind == "mtp" and head.config.serve_mode == "chain":
        from serving.drafters.mtp import MtpChainDrafter

        if config.topk > 1:
            raise ValueError(f"draft trees (topk > 1) apply to MTP heads with serve_mode 'reuse_first'; {config.model} has "
                             "serve_mode 'chain': set serve_mode 'reuse_first' in its config.json, or leave topk 1")
        if config.num_speculative_tokens > head.config.depth:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this MTP head's depth "
                             f"{head.config.depth} (serve_mode 'chain' drafts one token per module): draft fewer "
                             "tokens or set serve_mode 'reuse_first' in its config.json")
        return MtpChainDrafter(ctx, head, token_map, config.confidence_threshold)
    if kind == "dflash":
        from serving.drafters.dflash import DFlashDrafter

        if config.num_speculative_tokens > head.config.block_size - 1:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds the {head.config.block_size - 1} "
                             f"drafts of this DFlash head's block (block_size={head.config.block_size}): draft fewer "
                             "tokens, or train a head with longer blocks")
        return DFlashDrafter(ctx, head, token_map, config)
    if kind == "peagle":
        from serving.drafters.peagle import PeagleDrafter

        return PeagleDrafter(ctx, head, config)
    from serving.drafters.eagle import EagleDrafter

    return EagleDrafter(ctx, head, token_map, config)


def log_confidence(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(argmax) under softmax(logits / temperature), without materialising the softmax: [..., vocab] -> [...].
    The one definition the cut reads and training calibrates against."""
    shifted = logits.float() - logits.amax(-1, keepdim=True).float()
    return -torch.logsumexp(shifted / temperature, dim=-1)


def top_log_probs(logits: torch.Tensor, num: int, temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `num` most likely entries of each row of logits: (their log-probabilities under softmax(logits /
    temperature), [..., num]; their indices, [..., num]). temperature: one for every row, or a tensor of each row's
    that broadcasts as [..., 1]. One fused log-softmax reads the rows once (logsumexp takes five passes: 2-3x the
    time on a drafter's few rows after a forward has evicted the caches)."""
    return (logits.float() / temperature).log_softmax(-1).topk(num, dim=-1)


class Confidence:
    """The head's probability of a draft at depth d is read at the temperature its fit calibrated for draft d
    (`confidence_temperatures` in its config.json, 1 past them): the estimate that the target accepts it. A path's
    score is the sum of those log-probabilities; `confidence_threshold` (or the adaptive policy's price of a row, per
    request) prunes nodes whose path probability falls below it (a draft pays when the chance that it and every
    draft before it land exceeds what verifying and drafting one more token costs as a share of a step)."""

    def __init__(self, head, threshold: float):
        self.log_threshold = math.log(threshold) if threshold > 0 else -math.inf
        self.temperatures = list(head.config.confidence_temperatures)

    def log_threshold_for(self, budget) -> float:
        """The cut for a request drafted within `budget` (serving.drafters.base.DraftBudget): the config's threshold,
        or the adaptive policy's price of a row where that is higher."""
        return max(self.log_threshold, budget.min_log_survival)

    def temperature(self, depth: int) -> float:
        """T of the drafts at `depth` (1 for the newest token's children)."""
        return self.temperatures[depth - 1] if depth - 1 < len(self.temperatures) else 1.0


