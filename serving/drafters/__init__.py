"""Drafters propose token trees for the target to verify, behind one interface (`serving.drafters.base.Drafter`), one
drafter per file: ngram.py (prompt lookup), draft_model.py, early_exit.py, medusa.py, eagle.py (EAGLE-1, EAGLE-3),
mtp.py (MTP: one module per draft, or its first module reused as EAGLE's), peagle.py (P-EAGLE, a block of drafts per
forward), dflash.py (DFlash, a block per forward), dspark.py (DSpark: DFlash's block and a Markov head's
left-to-right pass), lookahead.py (lookahead decoding: Jacobi iteration and an n-gram
pool), suffix.py (suffix decoding: suffix trees over the request and earlier answers), grammar.py (nothing but the
tokens a request's grammar forces), and fallback.py (prompt lookup or suffix decoding first, then a head).

`DRAFTERS` maps each method, or for heads the loaded head's kind (head.py, `drafter_kind`), to its class; each class
names its keys (`kinds`), checks its options and builds itself (`check`, `build`)."""
from __future__ import annotations

from serving.drafters.base import Drafter
from serving.drafters.context import DraftContext
from serving.drafters.dflash import DFlashDrafter
from serving.drafters.draft_model import DraftModelDrafter
from serving.drafters.dspark import DSparkDrafter
from serving.drafters.eagle import EagleDrafter
from serving.drafters.early_exit import EarlyExitDrafter
from serving.drafters.fallback import Fallback
from serving.drafters.grammar import GrammarDrafter
from serving.drafters.head import drafter_kind, load_head
from serving.drafters.lookahead import LookaheadDrafter
from serving.drafters.medusa import MedusaDrafter
from serving.drafters.mtp import MtpChainDrafter, MtpReuseFirstDrafter
from serving.drafters.ngram import NgramDrafter
from serving.drafters.peagle import PeagleDrafter
from serving.drafters.suffix import SuffixDrafter, SuffixFirstChoice
from serving.spec_decode.config import HEADS, SpeculativeConfig

DRAFTERS: dict[str, type[Drafter]] = {
    kind: cls for cls in (NgramDrafter, SuffixDrafter, GrammarDrafter, LookaheadDrafter, DraftModelDrafter,
                          EarlyExitDrafter, MedusaDrafter, EagleDrafter, MtpChainDrafter, MtpReuseFirstDrafter,
                          PeagleDrafter, DFlashDrafter, DSparkDrafter)
    for kind in cls.kinds}


def make_drafter(ctx: DraftContext, config: SpeculativeConfig) -> Drafter:
    if config.method not in HEADS:
        return DRAFTERS[config.method].build(ctx, config)
    head, token_map = load_head(ctx, config)
    drafter = DRAFTERS[drafter_kind(head)].build(ctx, config, head, token_map)
    if config.prompt_lookup_first:
        return Fallback(NgramDrafter(config), drafter)
    if config.suffix_first:
        return Fallback(SuffixFirstChoice(config), drafter, share_name="suffix_share")
    return drafter
