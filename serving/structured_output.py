"""Structured outputs: a request's answer constrained to a JSON schema, any JSON object, a regular expression, a
choice among strings or a context-free grammar (Lark, or GBNF/EBNF as llama.cpp writes it), as vLLM's
`structured_outputs` (json, json_object, regex, choice, grammar) and OpenAI's `response_format` ask.

llguidance (vLLM's `guidance` backend) does all of the grammar work: it turns each kind into one grammar, checks
it, builds a token-level matcher over the target's tokenizer, and per matcher state gives the bitmask of allowed
tokens, the tokens the grammar forces next (`compute_ff_tokens`), and consume / rollback. Here:
- `StructuredOutputs`: what a request asks for, checked once when its SamplingParams are made (a bad schema, regex
  or grammar is a ValueError naming the problem); the grammar text is cached by the request's key.
- `Grammars`: one per engine, the tokenizer wrapped once (about a second for a 49k vocabulary) and one compiled
  matcher per key, which each request copies (`matcher`), so a schema many requests share is compiled once.
- `mask_logits`: logits rows with every token a row's bitmask forbids set to -inf, the first thing a request's
  sampling law sees (before penalties, temperature, top-k, top-p and min-p, as in vLLM).
"""
from __future__ import annotations

import functools
import json
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` a JSON schema (a dict or its JSON text), `json_object` any JSON object, `regex` a
    regular expression (Rust's regex syntax) over the whole answer, `choice` one of these strings, `grammar` a Lark
    grammar or a GBNF (EBNF) grammar."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # vLLM's name: a JSON answer written without optional whitespace (compact `,` and `:`), so that every key and
    # separator a schema fixes is one forced run of tokens (grammar drafts) instead of a place to choose spacing.
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as error:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema))  # key order kept: it orders the properties
        if self.json_object is not True and self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if self.disable_any_whitespace is not True and self.disable_any_whitespace is not False:
            raise ValueError(f"structured_outputs.disable_any_whitespace must be true or false, got "
                             f"{self.disable_any_whitespace!r}")
        if self.disable_any_whitespace and self.json is None and not self.json_object:
            raise ValueError("structured_outputs.disable_any_whitespace applies to json and json_object only; drop it "
                             "for regex, choice and grammar (their whitespace is what they spell out)")
        grammar_text(self.key)  # checked now: a bad one fails where the request is made

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputs":
        unknown = set(fields) - set(KINDS) - {"disable_any_whitespace"}
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(sorted(unknown))}: it takes "
                             f"{', '.join(KINDS)} and disable_any_whitespace")
        return cls(**fields)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what identifies the grammar, for the caches."""
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            if self.disable_any_whitespace:
                schema["x-guidance"] = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
            return "json", json.dumps(schema)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar


@functools.lru_cache(maxsize=1024)
def grammar_text(key: tuple[str, str]) -> str:
    """The llguidance grammar for a StructuredOutputs key, checked (a ValueError names what is wrong)."""
    kind, text = key
    try:
        grammar = llguidance.grammar_from(kind, text)
    except ValueError as error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {error}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")
    return grammar


class Grammars:
    """The target's tokenizer as llguidance reads it (built on first use from `make_tokenizer`), and a compiled
    matcher per grammar key (the least recently used dropped past `max_cached`); `matcher` hands each request a copy
    in the grammar's start state."""

    def __init__(self, make_tokenizer, max_cached: int = 256):
        self.make_tokenizer = make_tokenizer
        self.max_cached = max_cached
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_hf(cls, tokenizer, vocab_size: int, eos_token_ids, target) -> "Grammars":
        """From the target's Hugging Face fast tokenizer (None: structured outputs are refused, naming `target`);
        `vocab_size` is the target's (its logits' width, padding included) and `eos_token_ids` its end tokens, which
        a grammar allows where the answer may end."""
        def make():
            if tokenizer is None:
                raise ValueError(f"structured_outputs need the target's tokenizer and {target} has none")
            import llguidance.hf

            return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        return cls(make)

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self.make_tokenizer()

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_tokens)

    def matcher(self, structured: StructuredOutputs) -> llguidance.LLMatcher:
        key = structured.key
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar_text(key), log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{key[0]} is invalid: {compiled.get_error()}")
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled.deep_copy()

    def new_bitmask(self, num_rows: int) -> np.ndarray:
        """[num_rows, words] int32, every token allowed."""
        return llguidance.numpy.allocate_token_bitmask(num_rows, self.tokenizer.vocab_size)

    def bitmask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """[1, words]: the tokens the matcher's state allows next."""
        bitmask = self.new_bitmask(1)
        self.fill(matcher, bitmask, 0)
        return bitmask

    def fill(self, matcher: llguidance.LLMatcher, bitmask: np.ndarray, row: int) -> None:
        """Row `row` of `bitmask`: the tokens the matcher's state allows next."""
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)


def is_allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def mask_logits(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """logits: [rows, vocab]; bitmask: [rows, words]. A float32 copy on the host with forbidden tokens at -inf."""
    masked = logits.detach().to("cpu", torch.float32, copy=True)
    llguidance.numpy.apply_token_bitmask_inplace(masked.numpy(), bitmask)
    return masked
