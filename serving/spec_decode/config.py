"""`SpeculativeConfig`: which drafter, how many drafts, configured like vLLM's `--speculative-config` JSON."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass

METHODS = ("ngram", "suffix", "draft_model", "early_exit", "medusa", "eagle", "eagle3", "mtp", "peagle", "dflash",
           "dspark", "lookahead", "grammar")
NEEDS_MODEL = ("draft_model", "medusa", "eagle", "eagle3", "mtp", "peagle", "dflash", "dspark")
HEADS = ("medusa", "eagle", "eagle3", "mtp", "peagle", "dflash", "dspark")  # trained draft heads: they read the target's hidden states
TAKES_TOKEN_MAP = ("medusa", "eagle", "mtp", "dflash", "dspark")
DRAFT_WEIGHTS = ("bfloat16", "float32", "int8")
REJECTION_SAMPLE_METHODS = ("standard", "block")  # vLLM's also has "synthetic", which changes the output law


@dataclass
class SpeculativeConfig:
    method: str
    # the deepest draft (default 4; lookahead: ngram - 1, its candidates' length, which it may cap; suffix:
    # suffix_decoding_max_tree_depth, as vLLM's, a cap that the match length and min_token_prob rarely let it reach)
    num_speculative_tokens: int | None = None
    # ngram, and heads with prompt_lookup_first: the shortest suffix to look up and the longest. ngram defaults as
    # vLLM's, so that one JSON means one drafter in both engines: a missing one takes the other's value, 5 and 5 when
    # neither is given. Heads looking up first default to 2 and 3.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: a target name or folder; medusa/eagle/eagle3/mtp/peagle: a head folder
    num_layers: int | None = None  # early_exit: how many of the target's layers draft
    # draft_model: sample drafts at this temperature (supplying q, their law) instead of greedy drafting; the other
    # drafters pick theirs deterministically (q one-hot) and refuse it
    draft_temperature: float | None = None
    # medusa/eagle/mtp: a file of token ids (`draftheads token-map`, SGLang's --speculative-token-map): the head
    # drafts among those tokens only, reading just their rows of the LM head (FR-Spec). A head trained over a map
    # drafts among it without this; a different map is refused.
    token_map: str | None = None
    # medusa/eagle/eagle3/mtp/peagle: end a chain before the first draft where the product of the head's probabilities
    # of the chain's drafts (at the temperatures its fit calibrated, `confidence_temperatures` in its config.json)
    # falls below this, so steps where the head is unsure verify fewer tokens (0: always draft
    # num_speculative_tokens).
    confidence_threshold: float = 0.0
    # medusa/eagle/eagle3/mtp/peagle: how the head's weights (and its token map's LM-head rows) are stored for the CPU
    # kernels: "bfloat16" (default when unset) streams half the bytes per draft and still computes in float32;
    # "int8" a quarter, each output row of a matrix over a float32 scale of its own; drafts may differ from float32
    # ones, outputs never do (the target verifies every draft).
    draft_weights: str | None = None
    # medusa/eagle/eagle3/mtp/peagle: draft by prompt lookup (as ngram, prompt_lookup_min..max) where the sequence's
    # last tokens occurred before, and by the head where they did not. A 1-token suffix nearly always occurred before
    # and takes steps from the head for little, hence a default minimum of 2 here.
    prompt_lookup_first: bool = False
    # medusa/eagle/eagle3/mtp/peagle: draft a token tree, EAGLE-2's dynamic tree (SGLang's speculative_eagle_topk,
    # speculative_num_draft_tokens; num_speculative_tokens is its speculative_num_steps): for num_speculative_tokens
    # depths expand the topk most likely children of the topk best nodes so far, each node scored by the product of
    # the head's probabilities along its path, then keep the num_draft_tokens - 1 best nodes. topk 1 is a chain.
    topk: int = 1
    # the tree's size counting the verified newest token, as SGLang's (default: num_speculative_tokens + 1 for a
    # chain, num_speculative_tokens * topk + 1 for a tree)
    num_draft_tokens: int | None = None
    # medusa: a static tree, as Medusa's medusa_choices: paths of top-k ranks of its heads, e.g. [[0], [0, 0], [1],
    # [0, 1]] (node [0, 1]: head 1's second most likely token after head 0's most likely one); every path's
    # prefixes listed too.
    medusa_choices: list | None = None
    # lookahead (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"): the
    # Jacobi window's width W, the n-gram size N (the window keeps N - 1 levels; candidates are N - 1 tokens after the
    # newest one) and the most candidates G verified per step. Defaults: the paper's setting for its smallest models
    # (Llama-2-7B: W 15, N 5, G 15, also llama.cpp's example); each step computes (W - 1) + (N - 2) W window rows
    # and up to G (N - 1) candidate nodes, so on a few CPU cores small W and G pay (docs/benchmarks/suffix-lookahead.md).
    window: int | None = None
    ngram: int | None = None
    max_candidates: int | None = None
    # suffix (vLLM's names and defaults; Arctic Inference's suffix trees, serving/drafters/suffix.py): the trees'
    # depth, which bounds the match plus the draft; the answers the global tree keeps (the oldest evicted first; 0:
    # no global tree, the request's own tree only); drafts of at most max_spec_factor * (the match's length) tokens;
    # no draft whose estimated probability (the product of its path's frequencies) is below min_token_prob.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # medusa/eagle/eagle3/mtp: draft by suffix decoding (the suffix options above, within the head's
    # num_speculative_tokens and num_draft_tokens) wherever its tree's score, the tokens its frequencies expect
    # accepted, is at least suffix_first_min_score, and by the head elsewhere: Arctic Inference's hybrid rule,
    # whose threshold is the head's draft length; 1 here, above what a head trained on little data expects from a
    # step (serving/drafters/fallback.py).
    suffix_first: bool = False
    suffix_first_min_score: float = 1.0
    # any method: no drafts in a step where more than this many requests are running (as vLLM's): past a few
    # sequences a step is no longer bound by reading the weights once, and every verified draft costs compute.
    # Drafters with a pool of their own still catch up every step.
    disable_by_batch_size: int | None = None
    # any method: choose each step, per request, a tree depth from 0 to num_speculative_tokens (trees scaled to it) that
    # maximises the batch's expected tokens per second, from a step-cost model measured on this device and each
    # request's own acceptance (serving/spec_decode/adaptive.py). Off by default: a fixed setting is what vLLM and SGLang run
    # and what published numbers use; disable_by_batch_size and confidence_threshold still apply on top.
    adaptive: bool = False
    # any method: for structured-output requests that allow it (SamplingParams.grammar_drafts, on by default), the
    # tokens the grammar forces are drafted before the drafter's own (serving/spec_decode/grammar.py); false leaves
    # the drafter's alone, cut to what the grammar allows. Method "grammar" drafts nothing itself: the forced
    # tokens are all its drafts.
    grammar_drafts: bool = True
    # any method, sampled requests (temperature > 0): how a chain of drafts is verified, vLLM's option and values.
    # "standard": token by token, stopping at the first rejected draft. "block": block verification (Sun et al. 2024),
    # which accepts the chain's prefix from the joint law of the whole block: exact too, and never fewer accepted
    # tokens in expectation; it gains over "standard" only for drafters that sample (q spread out, e.g. draft_model
    # with draft_temperature) and equals it in expectation for deterministic drafts (serving/spec_decode/verify.py).
    # Trees are verified by the standard rules whatever this says (the rule is for one chain); configs that draft
    # trees warn. Greedy requests are unaffected.
    rejection_sample_method: str = "standard"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        self._check_lookahead()
        self._check_suffix()
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = (self.ngram - 1 if self.method == "lookahead" else
                                           self.suffix_decoding_max_tree_depth if self.method == "suffix" else 4)
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be an integer >= 1")
        if self.method == "lookahead" and self.num_speculative_tokens > self.ngram - 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} exceeds lookahead's candidates of "
                             f"ngram - 1 = {self.ngram - 1} tokens (leave it unset, or raise ngram)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive={self.adaptive!r} must be true or false")
        if not isinstance(self.grammar_drafts, bool):
            raise ValueError(f"grammar_drafts={self.grammar_drafts!r} must be true or false")
        if self.method == "grammar" and not self.grammar_drafts:
            raise ValueError("method \"grammar\" drafts only the tokens a grammar forces: grammar_drafts must be true")
        if not isinstance(self.prompt_lookup_first, bool):
            raise ValueError(f"prompt_lookup_first={self.prompt_lookup_first!r} must be true or false")
        if self.prompt_lookup_first and self.method not in HEADS:
            raise ValueError(f"prompt_lookup_first applies to {', '.join(HEADS)} heads, not {self.method!r}"
                             + (" (which drafts by prompt lookup alone)" if self.method == "ngram" else ""))
        self._default_lookup()
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
        self._check_tree()
        self._check_rejection_sample_method()
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size={self.disable_by_batch_size!r} must be an integer >= 1 "
                             "(leave it unset to draft at every batch size)")
        if self.draft_temperature is not None and self.method != "draft_model":
            # the other drafters pick their drafts deterministically (the heads their most likely tokens): q is one-hot
            raise ValueError(f"draft_temperature applies to draft_model, not {self.method!r}, which drafts its most "
                             "likely tokens; leave it out")
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ValueError(f"draft_temperature={self.draft_temperature} must be >= 0")

    def _default_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.prompt_lookup_first:
            low, high = 2 if low is None else low, 3 if high is None else high
        elif low is None and high is None:
            low = high = 5
        else:
            low, high = high if low is None else low, low if high is None else high
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    def _check_lookahead(self) -> None:
        options = {"window": self.window, "ngram": self.ngram, "max_candidates": self.max_candidates}
        if self.method != "lookahead":
            given = [name for name, value in options.items() if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to lookahead, "
                                 f"not {self.method!r}")
            return
        defaults = {"window": 15, "ngram": 5, "max_candidates": 15}
        for name, value in options.items():
            value = defaults[name] if value is None else value
            least = 3 if name == "ngram" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"lookahead's {name}={value!r} must be an integer >= {least}"
                                 + (" (the window keeps ngram - 1 >= 2 levels)" if name == "ngram" else ""))
            setattr(self, name, value)

    def _check_suffix(self) -> None:
        if not isinstance(self.suffix_first, bool):
            raise ValueError(f"suffix_first={self.suffix_first!r} must be true or false")
        if self.suffix_first and self.method not in HEADS:
            raise ValueError(f"suffix_first applies to {', '.join(HEADS)} heads, not {self.method!r}"
                             + (" (which drafts by suffix decoding alone)" if self.method == "suffix" else ""))
        if self.suffix_first and self.prompt_lookup_first:
            raise ValueError("give either suffix_first or prompt_lookup_first, not both: each decides per step where "
                             "the head drafts")
        options = {"suffix_decoding_max_tree_depth": self.suffix_decoding_max_tree_depth,
                   "suffix_decoding_max_cached_requests": self.suffix_decoding_max_cached_requests,
                   "suffix_decoding_max_spec_factor": self.suffix_decoding_max_spec_factor,
                   "suffix_decoding_min_token_prob": self.suffix_decoding_min_token_prob,
                   "suffix_first_min_score": self.suffix_first_min_score}
        if self.method != "suffix" and not self.suffix_first:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            given = [name for name, value in options.items() if value != defaults[name]]
            if given:
                raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to suffix and to heads "
                                 f"with suffix_first, not {self.method!r}")
            return
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not is_int(depth) or depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth={depth!r} must be an integer >= 1 (the trees' depth: the "
                             "match plus the draft; vLLM's default is 24)")
        if not is_int(cached) or cached < 0:
            raise ValueError(f"suffix_decoding_max_cached_requests={cached!r} must be an integer >= 0 (0: no global "
                             "tree of earlier answers)")
        if not is_number(factor) or factor < 0:
            raise ValueError(f"suffix_decoding_max_spec_factor={factor!r} must be a number >= 0 (drafts of at most "
                             "factor * the match's length tokens)")
        if not is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob={prob!r} must be a probability in [0, 1]")
        if self.method == "suffix" and self.suffix_first_min_score != 1.0:
            raise ValueError("suffix_first_min_score applies to heads with suffix_first, not 'suffix'")
        if not is_number(self.suffix_first_min_score) or self.suffix_first_min_score < 0:
            raise ValueError(f"suffix_first_min_score={self.suffix_first_min_score!r} must be a number >= 0 (the "
                             "tokens a suffix draft expects accepted for it to replace the head's)")

    @property
    def num_lookahead_rows(self) -> int:
        """Lookahead's window rows per step (computed, never accepted): W - 1 at level 0, W at each further level."""
        return self.window - 1 + (self.ngram - 2) * self.window if self.method == "lookahead" else 0

    def _check_tree(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(self.topk, int) or isinstance(self.topk, bool) or self.topk < 1:
            raise ValueError(f"topk={self.topk!r} must be an integer >= 1 (1: a chain)")
        if (self.topk > 1 or self.medusa_choices is not None) and self.method not in HEADS:
            own = "its tree is its candidates' trie" if self.method == "lookahead" else "it drafts a chain"
            raise ValueError(f"draft trees (topk, medusa_choices) apply to {', '.join(HEADS)} heads, not {self.method!r}: "
                             + own)
        if self.medusa_choices is not None:
            if self.method != "medusa":
                raise ValueError(f"medusa_choices applies to medusa heads, not {self.method!r}: use topk and "
                                 "num_draft_tokens for a dynamic tree")
            if self.topk > 1:
                raise ValueError("give either medusa_choices (a static tree) or topk (a dynamic one), not both")
            self.medusa_choices = check_medusa_choices(self.medusa_choices, k)
        if self.method == "suffix":  # any tree of k depths
            most, shape = math.inf, "suffix"
        elif self.method == "lookahead":  # the candidates' trie, at most
            most, shape = self.max_candidates * k, f"max_candidates={self.max_candidates} of {k} tokens"
        elif self.medusa_choices is not None:
            most, shape = len(self.medusa_choices), "its medusa_choices"
        else:
            most, shape = self.topk + (k - 1) * self.topk ** 2, f"topk={self.topk} over {k} depths"
        if self.num_draft_tokens is None:
            self.num_draft_tokens = (1 + len(self.medusa_choices) if self.medusa_choices is not None
                                     else 1 + most if self.method == "lookahead" else 1 + k * self.topk)
        n = self.num_draft_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise ValueError(f"num_draft_tokens={n!r} must be an integer >= 2 (it counts the verified newest token, "
                             "as SGLang's)")
        if self.medusa_choices is None and self.method != "suffix" and n < k + 1:
            raise ValueError(f"num_draft_tokens={n} cannot hold a path of num_speculative_tokens={k} drafts: it counts "
                             f"the verified newest token as SGLang's does, so set num_draft_tokens >= {k + 1} or draft "
                             f"fewer tokens")
        if n - 1 > most:
            raise ValueError(f"num_draft_tokens={n} asks for {n - 1} draft nodes but the tree has {most} candidates at most "
                             f"({shape}):"
                             f" set num_draft_tokens <= {most + 1}")

    def _check_rejection_sample_method(self) -> None:
        method = self.rejection_sample_method
        if method == "synthetic":
            raise ValueError("rejection_sample_method='synthetic' is vLLM's benchmarking mode, which accepts drafts at "
                             "given rates and so changes what the model outputs; draftheads verifies exactly: use "
                             "'standard' or 'block'")
        if method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"rejection_sample_method={method!r} is unknown; choose one of "
                             f"{', '.join(REJECTION_SAMPLE_METHODS)}")
        if method == "block" and self.drafts_trees:
            warnings.warn(f"rejection_sample_method 'block' verifies chains; {self.method!r} with this config drafts "
                          "trees, which are verified token by token as with 'standard' (block verification is "
                          "defined for one chain); a step whose draft is a chain still uses it", stacklevel=3)

    @property
    def drafts_trees(self) -> bool:
        """Whether a step's draft may branch: suffix decoding's trees (also a head's suffix_first), lookahead's tries, a
        head's tree (topk > 1 or medusa_choices)."""
        return (self.method in ("suffix", "lookahead") or self.suffix_first or self.topk > 1
                or self.medusa_choices is not None)

    @property
    def max_draft_nodes(self) -> int:
        """The most rows a step computes for one request after its newest token: draft nodes, lookahead's window."""
        return self.num_draft_tokens - 1 + self.num_lookahead_rows

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
        """The method, prompt lookup first with its shortest suffix, suffix decoding's depth, nodes and (where not vLLM's
        defaults) minimum token probability and spec factor, a draft model's sampling temperature, the tree (topk and size, or Medusa's choices), the confidence
        threshold and the batch size that turns drafting off when set, the adaptive policy, block verification, and float32
        draft weights: a bench row's name."""
        label = self.method + (f"+lookup{self.prompt_lookup_min}" if self.prompt_lookup_first else "")
        label += f"+suffix{self.suffix_first_min_score:g}" if self.suffix_first else ""
        if self.method == "suffix":
            label += f" k{self.num_speculative_tokens} n{self.num_draft_tokens}"
            defaults = type(self)
            if self.suffix_decoding_min_token_prob != defaults.suffix_decoding_min_token_prob:
                label += f" p{self.suffix_decoding_min_token_prob:g}"
            if self.suffix_decoding_max_spec_factor != defaults.suffix_decoding_max_spec_factor:
                label += f" x{self.suffix_decoding_max_spec_factor:g}"
        if self.method == "lookahead":
            label += f" W{self.window} N{self.ngram} G{self.max_candidates}"
        label += f" draft T{self.draft_temperature:g}" if self.draft_temperature else ""
        if self.medusa_choices is not None:
            label += f" choices{len(self.medusa_choices)}"
        elif self.topk > 1:
            label += f" top{self.topk} n{self.num_draft_tokens}"
        label += f" p>={self.confidence_threshold:g}" if self.confidence_threshold else ""
        label += f" batch<={self.disable_by_batch_size}" if self.disable_by_batch_size else ""
        label += " adaptive" if self.adaptive else ""
        label += " -grammar drafts" if not self.grammar_drafts else ""
        label += " block" if self.rejection_sample_method == "block" else ""
        return label + (f" ({self.draft_weights} weights)" if self.draft_weights in ("float32", "int8") else "")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_medusa_choices(choices, max_depth: int) -> list[tuple[int, ...]]:
    """Medusa's static tree: a list of paths of top-k ranks, each path's prefixes listed too; returned in topological
    order (by length, then as listed)."""
    example = "e.g. [[0], [1], [0, 0], [0, 1]]"
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"medusa_choices={choices!r} must be a non-empty list of paths of ranks, {example}")
    paths = []
    for path in choices:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ValueError(f"medusa_choices: {path!r} is not a path of ranks (a non-empty list of integers >= 0), {example}")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise ValueError(f"medusa_choices lists a path twice: {sorted(p for p in set(paths) if paths.count(p) > 1)[0]}")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"medusa_choices has {list(path)} but not its parent {list(path[:-1])}: list every prefix")
        if len(path) > max_depth:
            raise ValueError(f"medusa_choices has {list(path)} of depth {len(path)} but num_speculative_tokens is "
                             f"{max_depth}: raise num_speculative_tokens to the deepest path's length")
    return sorted(paths, key=len)
