"""`SpeculativeConfig`: which drafter, how many drafts, configured like vLLM's `--speculative-config` JSON."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from serving.attention import MAX_BATCHED_QUERY_LEN

METHODS = ("ngram", "draft_model", "early_exit", "medusa", "eagle", "eagle3", "mtp")
NEEDS_MODEL = ("draft_model", "medusa", "eagle", "eagle3", "mtp")
HEADS = ("medusa", "eagle", "eagle3", "mtp")  # trained draft heads: they read the target's hidden states
TAKES_TOKEN_MAP = ("medusa", "eagle", "mtp")
DRAFT_WEIGHTS = ("bfloat16", "float32")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    # ngram, and heads with prompt_lookup_first: the shortest suffix to look up (default 1 for ngram, 2 for heads)
    # and the longest
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int = 3
    model: str | None = None  # draft_model: a target name or folder; medusa/eagle/eagle3/mtp: a head folder
    num_layers: int | None = None  # early_exit: how many of the target's layers draft
    draft_temperature: float | None = None  # draft_model: sample drafts (supplying q) instead of greedy drafting
    # medusa/eagle/mtp: a file of token ids (`draftheads token-map`, SGLang's --speculative-token-map): the head
    # drafts among those tokens only, reading just their rows of the LM head (FR-Spec). A head trained over a map
    # drafts among it without this; a different map is refused.
    token_map: str | None = None
    # medusa/eagle/eagle3/mtp: end a chain before the first draft where the product of the head's probabilities of
    # the chain's drafts (at the temperatures its fit calibrated, `confidence_temperatures` in its config.json)
    # falls below this, so steps where the head is unsure verify fewer tokens (0: always draft
    # num_speculative_tokens).
    confidence_threshold: float = 0.0
    # medusa/eagle/eagle3/mtp: how the head's weights (and its token map's LM-head rows) are stored for the CPU
    # kernels: "bfloat16" (default when unset) streams half the bytes per draft and still computes in float32;
    # drafts may differ from float32 ones, outputs never do (the target verifies every draft).
    draft_weights: str | None = None
    # medusa/eagle/eagle3/mtp: draft by prompt lookup (as ngram, prompt_lookup_min..max) where the sequence's last
    # tokens occurred before, and by the head where they did not. A 1-token suffix nearly always occurred before
    # and takes steps from the head for little, hence a default minimum of 2 here.
    prompt_lookup_first: bool = False
    # medusa/eagle/eagle3/mtp: verify the head's first_draft_topk most likely first drafts, the chain going on from
    # the first and each other as a leaf in a row of its own (a tree: as SGLang's speculative_eagle_topk at the first
    # step only). With confidence_threshold a leaf is verified only where its probability reaches it.
    first_draft_topk: int = 1
    # any method: no drafts in a step where more than this many requests are running (as vLLM's): past a few
    # sequences a step is no longer bound by reading the weights once, and every verified draft costs compute.
    # Drafters with a pool of their own still catch up every step.
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be an integer >= 1")
        if not isinstance(self.prompt_lookup_first, bool):
            raise ValueError(f"prompt_lookup_first={self.prompt_lookup_first!r} must be true or false")
        if self.prompt_lookup_first and self.method not in HEADS:
            raise ValueError(f"prompt_lookup_first applies to {', '.join(HEADS)} heads, not {self.method!r}"
                             + (" (which drafts by prompt lookup alone)" if self.method == "ngram" else ""))
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = 2 if self.prompt_lookup_first else 1
        looks_up = self.method == "ngram" or self.prompt_lookup_first
        if looks_up and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max={self.prompt_lookup_max} "
                             "must satisfy 1 <= min <= max")
        if self.method in NEEDS_MODEL and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs \"model\": "
                             + ("a draft target name or folder" if self.method == "draft_model" else "a head folder"))
        if self.method == "early_exit" and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f"early_exit needs \"num_layers\" >= 1 (got {self.num_layers!r})")
        if self.token_map and self.method not in TAKES_TOKEN_MAP:
            raise ValueError(f"token_map applies to {', '.join(TAKES_TOKEN_MAP)} heads, not {self.method!r}"
                             + (" (an EAGLE-3 head drafts over its own draft vocabulary)" if self.method == "eagle3" else ""))
        if not isinstance(self.confidence_threshold, (int, float)) or not 0 <= self.confidence_threshold < 1:
            raise ValueError(f"confidence_threshold={self.confidence_threshold!r} must be in [0, 1) "
                             "(0 drafts num_speculative_tokens every step)")
        if self.confidence_threshold and self.method not in HEADS:
            raise ValueError(f"confidence_threshold applies to {', '.join(HEADS)} heads, not {self.method!r}")
        if self.draft_weights is not None:
            if self.method not in HEADS:
                raise ValueError(f"draft_weights applies to {', '.join(HEADS)} heads, not {self.method!r}")
            if self.draft_weights not in DRAFT_WEIGHTS:
                raise ValueError(f"draft_weights={self.draft_weights!r} must be one of {', '.join(DRAFT_WEIGHTS)}")
        if not isinstance(self.first_draft_topk, int) or self.first_draft_topk < 1:
            raise ValueError(f"first_draft_topk={self.first_draft_topk!r} must be an integer >= 1 (1: a chain alone)")
        if self.first_draft_topk > 1 and self.method not in HEADS:
            raise ValueError(f"first_draft_topk applies to {', '.join(HEADS)} heads, not {self.method!r}")
        if self.first_draft_topk > 1 and 1 + self.num_speculative_tokens > MAX_BATCHED_QUERY_LEN:
            raise ValueError(f"first_draft_topk > 1 needs num_speculative_tokens <= {MAX_BATCHED_QUERY_LEN - 1} (leaves branch off "
                             f"a chain verified as one short query), got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size={self.disable_by_batch_size!r} must be an integer >= 1 "
                             "(leave it unset to draft at every batch size)")
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ValueError(f"draft_temperature={self.draft_temperature} must be >= 0")

    @classmethod
    def from_json(cls, text: str | dict) -> "SpeculativeConfig":
        try:
            values = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON ({e}): {text!r}") from None
        if not isinstance(values, dict):
            raise ValueError(f"speculative config must be a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known keys: {', '.join(sorted(known))}")
        if "method" not in values:
            raise ValueError(f"speculative config needs \"method\" (one of {', '.join(METHODS)})")
        return cls(**values)

    def label(self) -> str:
        """The method, prompt lookup first with its shortest suffix, the first draft's top k, the confidence
        threshold and the batch size that turns drafting off when set, and float32 draft weights: a bench row's
        name."""
        label = self.method + (f"+lookup{self.prompt_lookup_min}" if self.prompt_lookup_first else "")
        label += f" top{self.first_draft_topk}" if self.first_draft_topk > 1 else ""
        label += f" p>={self.confidence_threshold:g}" if self.confidence_threshold else ""
        label += f" batch<={self.disable_by_batch_size}" if self.disable_by_batch_size else ""
        return label + (f" ({self.draft_weights} weights)" if self.draft_weights == "float32" else "")
