"""The grammar as the only drafter: it proposes nothing, so a structured-output request's drafts are the tokens its
grammar forces (serving/spec_decode/grammar.py), verified at no drafter cost; other requests decode plainly."""
from __future__ import annotations

from serving.drafters.base import Drafter


class GrammarDrafter(Drafter):
    kinds = ("grammar",)

    @classmethod
    def build(cls, ctx, config, head=None, token_map=None):
        return cls()

    def propose(self, ctx, requests, budgets):
        return {}
