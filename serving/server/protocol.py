"""The OpenAI API's request bodies as pydantic models, and how one becomes the engine's SamplingParams.

Every field a body may carry is declared; any other is refused by name (`extra="forbid"`), so a client never
believes a sampling option took effect when it did not. Beside OpenAI's fields they take vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos) and return_token_ids. `user` is accepted and
ignored: it only labels the caller. Ranges are checked once, by SamplingParams. `n` samples run as n sequences; with
a seed, sample i draws from seed + i, as vLLM's do.

Structured outputs: OpenAI's `response_format` ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and vLLM's `structured_outputs` (json, json_object, regex, choice,
grammar) become SamplingParams.structured_outputs; `grammar_drafts` (ours) turns the grammar's forced drafts off or on.
A bad schema or grammar is a 400 naming it (the compile error in the message).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.request import MAX_TOP_LOGPROBS, SamplingParams
from serving.structured_output import StructuredOutputs


class APIError(Exception):
    """An error the client caused or must hear about, sent as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}
        return {"error": {"message": self.message, "type": kind.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # an assistant turn that called tools may have none
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def to_engine(self) -> dict:
        """The message as chat templates read it (Hugging Face's layout: a call's arguments as an object)."""
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(
            part.text for part in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means any object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(StrictModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured_outputs(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, 'response_format of type "json_schema" needs json_schema.schema (a JSON schema '
                                'object)', "response_format")
        return {"json": self.json_schema.schema_}


class StructuredOutputsFields(StrictModel):
    """vLLM's structured_outputs: exactly one of json, json_object, regex, choice, grammar; disable_any_whitespace
    with json or json_object."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None

    def structured_outputs(self) -> dict:
        fields = self.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        return fields


class SamplingFields(StrictModel):
    """The fields chat and completions share."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default: absent means sampling, not greedy
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extra field; -1 also disables it
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    return_token_ids: bool = False  # vLLM's extra field: the prompt's and the answer's token ids beside the text
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None  # vLLM's
    grammar_drafts: bool | None = None  # ours: draft the tokens the grammar forces (default on with a grammar)

    def check(self) -> None:
        if self.n < 1:
            raise APIError(400, f"n={self.n} is invalid: ask for at least one choice", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.return_token_ids and self.stream:
            raise APIError(400, "return_token_ids is only supported for whole answers (stream: false)",
                           "return_token_ids")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured(self) -> tuple[dict | None, str | None]:
        """(the structured_outputs fields, the request field they came from)."""
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_outputs(), "structured_outputs"
        if self.response_format is not None:
            return self.response_format.structured_outputs(), "response_format"
        return None, None

    def samples(self, max_tokens: int, logprobs: bool, top_logprobs: int,
                prompt_logprobs: int | None = None) -> list[SamplingParams]:
        """The n samples' params: the same but for the seed, seed + i for sample i where a seed is given."""
        params = self.sampling_params(max_tokens, logprobs, top_logprobs, prompt_logprobs)
        if params.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=(params.seed + i) % 2**64) for i in range(self.n)]

    def sampling_params(self, max_tokens: int, logprobs: bool, top_logprobs: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        structured, structured_field = self.structured()
        try:
            structured = None if structured is None else StructuredOutputs.from_dict(structured)
        except ValueError as error:
            raise APIError(400, f"{structured_field}: {error}", structured_field) from None
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=0 if self.top_k == -1 else self.top_k, min_p=self.min_p, seed=self.seed,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias, logprobs=logprobs,
                top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                stop=self.stop or None, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                structured_outputs=structured, grammar_drafts=self.grammar_drafts)
        except ValueError as error:
            message = str(error).removeprefix("SamplingParams.")
            raise APIError(400, message, message.split("=", 1)[0]) from None


class ChatCompletionRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: "required" calls one tool

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: OpenAI's default is auto with tools and none without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def structured(self) -> tuple[dict | None, str | None]:
        """A named tool's arguments, or "required"'s list of calls, constrained by the tools' schemas."""
        if self.tool_mode not in ("named", "required"):
            return super().structured()
        if self.response_format is not None and self.response_format.type != "text" \
                or self.structured_outputs is not None:
            raise APIError(400, f"tool_choice {self.tool_mode!r} constrains the answer to tool calls: drop "
                                "response_format or structured_outputs", "tool_choice")
        from serving.server.tools import tool_call_schema

        return {"json": tool_call_schema(self.tools, self.tool_choice, self.parallel_tool_calls),
                "disable_any_whitespace": True}, "tools"

    def check(self) -> None:
        super().check()
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(400, f"tool_choice {self.tool_mode!r} needs tools: give the functions in tools",
                           "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                tool.function.name for tool in self.tools}:
            raise APIError(400, f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                                f"among the tools ({', '.join(tool.function.name for tool in self.tools)})",
                           "tool_choice")
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", "messages")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs={self.top_logprobs} is invalid: ask for 0 to {MAX_TOP_LOGPROBS}",
                           "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingFields):
    """OpenAI's text completions. With echo, the prompt's logprobs are the target's at the rows before each prompt
    token (vLLM's prompt_logprobs, taken from `logprobs` unless given); max_tokens 0 with echo scores the prompt only
    (as vLLM, one token is computed and left out of the text)."""
    prompt: str | list[int]
    logprobs: int | None = None  # OpenAI's completions: how many top alternatives; 0 is the sampled token only
    echo: bool = False  # the prompt before the answer, in the text and (with logprobs) the logprobs
    prompt_logprobs: int | None = None  # vLLM's extra field: each prompt token's logprob and this many alternatives

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs={self.logprobs} is invalid: ask for 0 to {MAX_TOP_LOGPROBS} alternatives",
                           "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"prompt_logprobs={self.prompt_logprobs} is invalid: ask for 0 to {MAX_TOP_LOGPROBS} "
                                "alternatives", "prompt_logprobs")
        for name in ("echo", "prompt_logprobs"):
            if self.stream and getattr(self, name) not in (False, None):
                raise APIError(400, f"{name} is only supported for whole answers (stream: false)", name)
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 generates nothing: ask for at least one token, or echo the prompt "
                                "(echo: true) to score it", "max_tokens")
        if not self.prompt:
            raise APIError(400, "prompt is empty: give a string or at least one token id", "prompt")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        return (1 if self.max_tokens == 0 else self.max_tokens), "max_tokens"

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """The alternatives per prompt token to compute: prompt_logprobs, else logprobs when echoing, else None."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


def parse(model: type[SamplingFields], data) -> SamplingFields:
    """A request body (decoded JSON) as `model`, or an APIError naming the first bad field."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            message = f"unknown field {where!r}; this endpoint takes {', '.join(sorted(model.model_fields))}"
        elif first["type"] == "missing":
            message = f"{where} is required"
        else:
            message = f"{where}: {first['msg']} (got {first.get('input')!r})"
        raise APIError(400, message, param) from None
    body.check()
    return body
