"""Drafters propose token trees for the target to verify, behind one interface (`serving.drafters.base.Drafter`), one
drafter per file: ngram.py (prompt lookup), draft_model.py, early_exit.py, medusa.py, eagle.py (EAGLE-1, EAGLE-3,
MTP reusing its first module), mtp.py (MTP, one module per draft), peagle.py (P-EAGLE, a block of drafts per
forward), dflash.py (DFlash, a block per forward), lookup_first.py (prompt lookup, then a head), lookahead.py
(lookahead decoding: Jacobi iteration and an n-gram pool), suffix.py (suffix decoding: suffix trees over the request
and earlier answers), suffix_first.py (suffix decoding, then a head), grammar.py (nothing but the tokens a
request's grammar forces)."""
from __future__ import annotations

from serving.drafters.context import DraftContext
from serving.spec_decode.config import SpeculativeConfig


def make_drafter(ctx: DraftContext, config: SpeculativeConfig):
    if config.method == "ngram":
        from serving.drafters.ngram import NgramDrafter

        return NgramDrafter(config)
    if config.method == "suffix":
        from serving.drafters.suffix import SuffixDrafter

        return SuffixDrafter(config)
    if config.method == "grammar":
        from serving.drafters.grammar import GrammarDrafter

        return GrammarDrafter()
    if config.method == "lookahead":
        from serving.drafters.lookahead import LookaheadDrafter

        return LookaheadDrafter(config)
    if config.method == "draft_model":
        from serving.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(ctx, config)
    if config.method == "early_exit":
        from serving.drafters.early_exit import EarlyExitDrafter

        return EarlyExitDrafter(ctx, config)
    from serving.drafters.head import make_head_drafter

    drafter = make_head_drafter(ctx, config)
    if config.prompt_lookup_first:
        from serving.drafters.lookup_first import LookupFirst
        from serving.drafters.ngram import NgramDrafter

        return LookupFirst(NgramDrafter(config), drafter)
    if config.suffix_first:
        from serving.drafters.suffix import SuffixDrafter
        from serving.drafters.suffix_first import SuffixFirst

        return SuffixFirst(SuffixDrafter(config), drafter, config)
    return drafter
