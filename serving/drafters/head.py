"""Trained heads (Medusa, EAGLE-1, EAGLE-3, MTP, P-EAGLE, DFlash, DSpark) as drafters: loading a head folder against the
engine's target, bound to the target's embedding, final norm and LM head, and the key of serving/drafters/__init__.py's
table that picks the drafter of a loaded head.

Medusa (drafters/medusa.py) reads the target's hidden state of the newest computed token and needs no K/V. EAGLE-1,
EAGLE-3, MTP and P-EAGLE (drafters/eagle.py, drafters/mtp.py, drafters/peagle.py) run a decoder layer of their own
over a pool with the target's block size, addressed by the target's block tables; DFlash and DSpark (drafters/dflash.py,
drafters/dspark.py) keep their layers' context K/V there. Each scores its drafts with drafters/confidence.py.
"""
from __future__ import annotations

import torch

import heads
from heads.token_map import lm_head_rows, load_token_map
from serving.kernels import PackedLinear, for_inference, kernel_head


def load_head(ctx, config):
    """(the head of folder config.model, bound to the target and packed for inference; the token map it drafts
    among, on the runner's device, or None)."""
    runner = ctx.runner
    head = heads.load(config.model, ctx.fingerprint)
    parts = heads.load_target_parts(ctx.target, fingerprint=ctx.fingerprint, weights=False)
    weight_dtype = getattr(torch, config.draft_weights or "bfloat16")
    # in the bfloat16 compute mode a head's bfloat16 products run as the target's do (dot products of bfloat16
    # pairs), at about twice the widened products' rate; float32 weights stay float32 products
    compute = ctx.compute if weight_dtype == torch.bfloat16 else torch.float32
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
        lm_head = PackedLinear(lm_head_rows(model.lm_head, token_map), weight_dtype, compute)
    else:
        lm_head = model.drafter_lm_head(weight_dtype, compute)
    parts.embed, parts.norm, parts.lm_head = model.embed, model.norm, lm_head
    head = head.bind_target(parts).to(runner.device, runner.dtype).eval().requires_grad_(False)
    head = kernel_head(for_inference(head, weight_dtype, compute))
    kind = head.config.kind
    if kind != config.method:
        raise ValueError(f"{config.model} holds a head of kind {kind!r}, but the speculative config says method {config.method!r}: "
                         f"use \"method\": \"{kind}\"")
    return head, token_map


def drafter_kind(head) -> str:
    """The drafter table's key of a loaded head: its kind, but for MTP heads its serve_mode's ('mtp' drafts one token
    per module, as trained; 'mtp_reuse_first' drafts every token with module 0, as EAGLE drafts)."""
    kind = head.config.kind
    return "mtp" if kind == "mtp" and head.config.serve_mode == "chain" else "mtp_reuse_first" if kind == "mtp" else kind
