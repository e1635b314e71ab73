"""A request's sampling parameters, its state inside the engine, and what it returns."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.tree import DraftTree
from serving.structured_output import StructuredOutputs

MAX_TOP_LOGPROBS = 20  # alternatives per token at most, vLLM's default max_logprobs


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps the whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # each emitted token's logprob under the target's distribution at its row (the grammar's mask applied, before
    # penalties, biases and temperature: vLLM's raw_logprobs), and the top_logprobs most likely tokens there
    logprobs: bool = False
    top_logprobs: int = 0
    # each prompt token's logprob under the target's distribution at the row before it (the first has none) and the
    # prompt_logprobs most likely tokens there; None: not asked. Such a request computes its whole prompt (it takes
    # no prefix-cache hits, whose rows are never computed).
    prompt_logprobs: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # the answer constrained to a JSON schema, JSON object, regex, choice or grammar (a dict of vLLM's fields works)
    structured_outputs: StructuredOutputs | dict | None = None
    # with structured_outputs and speculation: the tokens the grammar forces are drafted too (default on)
    grammar_drafts: bool | None = None

    def __post_init__(self):
        def bad(name, value, allowed):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")

        integer = lambda value: isinstance(value, int) and not isinstance(value, bool)
        number = lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not integer(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not number(self.temperature) or not self.temperature >= 0:
            bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not integer(self.top_k) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "a number in [0, 1]")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", self.seed, "an integer in [0, 2**64) or None")
        if not number(self.repetition_penalty) or not self.repetition_penalty > 0:
            bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 disables it)")
        if not number(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        if not number(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (
            isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop)
        ):
            bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(token): float(bias) for token, bias in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                bad("logit_bias", self.logit_bias, "a mapping of integer token ids to float biases")
        if not integer(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", self.top_logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            bad("top_logprobs", self.top_logprobs, "0 unless logprobs is true")
        if self.prompt_logprobs is not None and (not integer(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs, f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of integer token ids")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            bad("structured_outputs", self.structured_outputs, "a StructuredOutputs, a dict of its fields, or None")
        if self.grammar_drafts not in (None, True, False):
            bad("grammar_drafts", self.grammar_drafts, "true, false or None (on when structured_outputs is set)")
        if self.grammar_drafts is None:
            self.grammar_drafts = self.structured_outputs is not None
        elif self.grammar_drafts and self.structured_outputs is None:
            bad("grammar_drafts", self.grammar_drafts, "false without structured_outputs (there is no grammar to "
                "draft from)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """Penalties and biases make a step depend on more than the target's distribution (logprobs do not: they
        read the target's row, whatever drew the token)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecState:
    """One request's speculative state. `reset` (preemption, abort, finish) drops its drafts, the policy's estimate
    and every drafter's state at once; the acceptance counts stay, as they describe the whole request."""
    tree: DraftTree = field(default_factory=DraftTree)  # the drafts scheduled behind the newest token, to verify
    stats: AcceptanceStats | None = None  # its verify steps' acceptance counts, from its first verify step
    estimate: object = None  # the adaptive policy's view of its acceptance (serving.spec_decode.adaptive.Estimate)
    slots: dict = field(default_factory=dict)  # drafter -> that drafter's state for this request

    def reset(self) -> None:
        self.tree, self.estimate = DraftTree(), None
        self.slots.clear()


class Request:
    """One sequence in the engine. `token_ids` holds the prompt then every emitted token;
    `num_computed_tokens` of them have their K/V in the cache (the last emitted token never does
    until the next step computes it). `spec.tree` holds the drafts scheduled behind it for verification, a token
    tree whose nodes follow the last token in topological order; `spec_token_ids` are its tokens (setting a list
    schedules them as a chain)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids=()):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits at the last admission
        # one block table per KV cache group (serving.blocks): the full-attention group's first, then each window's
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[int] = []
        self.spec = SpecState()
        # llguidance.LLMatcher of a structured-output request, in the state after every emitted token; it outlives
        # preemption, which keeps the emitted tokens
        self.grammar = None
        self.generator = None  # torch.Generator of a sampled request, seeded by its params
        self.captured: list = []  # (hidden rows, {layer: rows}) per computed chunk in token order, when capturing
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per emitted token: (token, logprob), likeliest first
        # with params.prompt_logprobs, per prompt token: None (the first), else (its logprob, its rank in the
        # vocabulary, the likeliest (token, logprob) there), filled as its row is computed
        self.prompt_logprobs: list[tuple | None] = [None] * self.num_prompt_tokens
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def block_ids(self) -> list[int]:
        """The full-attention group's block table: every position's block (drafters' own pools are indexed by it)."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def spec_token_ids(self) -> list[int]:
        return list(self.spec.tree.tokens)

    @spec_token_ids.setter
    def spec_token_ids(self, tokens: list[int]) -> None:
        self.spec.tree = DraftTree.chain(tokens)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + self.spec.tree.num_rows

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    finished: bool
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with params.top_logprobs
    prompt_logprobs: list[tuple | None] | None = None  # with params.prompt_logprobs: Request.prompt_logprobs
    metrics: dict = field(default_factory=dict)  # timings, and acceptance counts when speculating
    hidden: object = None  # [prompt + output tokens, hidden] final hidden states (after the final norm), when captured
    aux: dict = field(default_factory=dict)  # layer id -> [prompt + output tokens, hidden], the input of that layer
