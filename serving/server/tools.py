"""Tool calling on chat completions, as vLLM serves it. The tools are rendered by the target's chat template in every
mode; what the answer may be, and how it is read, depends on tool_choice:

- a named function: the answer is that function's arguments, constrained by its JSON schema through the structured-
  output path (speculation and grammar drafts stay on); the reply's finish_reason stays the engine's ("stop"). The
  JSON has no free whitespace (structured_outputs' disable_any_whitespace): every separator is forced, so grammar
  drafts carry it, and no target can spend its tokens on blanks.
- "required": the answer is a JSON array of one or more {"name", "parameters"} objects, each a tool's name and
  arguments under that tool's schema (vLLM's schema, closed to other keys; one call at most with parallel_tool_calls
  false); finish_reason "tool_calls".
- "auto": the target answers freely and a tool-call parser chosen for its chat template reads the calls out of the
  text: `hermes` (vLLM's name: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Hermes, Qwen 2.5 and
  Qwen 3 write them) where the template uses <tool_call> tags; finish_reason "tool_calls" when it called one. A
  template with no parser known here refuses "auto", as vLLM does without --tool-call-parser.
- "none": nothing is parsed.

Calls come back in OpenAI's shape (id, type "function", function {name, arguments as JSON text}); streamed, a named
function's arguments stream as they are generated, "auto" streams its text until a <tool_call> tag opens, and the
calls of "required" and "auto" come in the choice's last chunks.
"""
from __future__ import annotations

import json
import re
import uuid

from serving.server.protocol import APIError, NamedToolChoice, Tool

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT = {"type": "object"}


def tool_call_parser(chat_template: str | None) -> str | None:
    """vLLM's name of the parser for calls written by a target with this chat template; None when none is known."""
    return "hermes" if chat_template and HERMES_START in chat_template else None


def tool_call_schema(tools: list[Tool], tool_choice, parallel_tool_calls: bool | None) -> dict:
    """The JSON schema of the answer: a named tool's arguments, or "required"'s array of calls."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(tool for tool in tools if tool.function.name == tool_choice.function.name)
        return tool.function.parameters or ANY_OBJECT
    calls = [{"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                             "parameters": tool.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": text}}


class ToolCalls:
    """One choice's tool calls: how its text becomes content and calls, whole or chunk by chunk."""

    def __init__(self, mode: str, tool_choice, parser: str | None):
        if mode == "auto" and parser is None:
            raise APIError(400, 'tool_choice "auto" needs a tool-call parser for the target\'s chat template, and '
                                "this one writes no calls this server can read (hermes: <tool_call> tags): name the "
                                'function in tool_choice, or ask for "required" or "none"', "tool_choice")
        self.mode = mode
        self.name = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
        self.text = ""  # every delta so far
        self.num_sent = 0  # characters of text streamed as content (auto) or arguments (named)
        self.named_call: dict | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def whole(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """(content, calls, finish_reason) of a whole answer."""
        if self.mode == "named":
            return "", [_call(self.name, text)], finish_reason
        if self.mode == "required":
            calls = self._required(text)
            return "", calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason
        content, calls = self._hermes(text)
        return content, calls, "tool_calls" if calls else finish_reason

    def delta(self, text: str) -> tuple[str, list[dict]]:
        """(content, call deltas) to stream for the next piece of text."""
        self.text += text
        if self.mode == "named":
            first = self.named_call is None
            if first:
                self.named_call = _call(self.name, "")
            arguments = self.text[self.num_sent:]
            self.num_sent = len(self.text)
            if not first and not arguments:
                return "", []
            call = {**self.named_call, "function": {"name": self.name, "arguments": arguments}} if first else \
                {"function": {"arguments": arguments}}
            return "", [{"index": 0, **call}]
        if self.mode == "required":
            return "", []
        # auto: content up to a tag that opens, holding back a tail that may be the start of one
        start = self.text.find(HERMES_START)
        end = start if start >= 0 else len(self.text) - _partial_tag(self.text)
        content = self.text[self.num_sent:end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return content, []

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        """(content still held back, the calls not streamed yet, finish_reason) once the choice is whole."""
        if self.mode == "named":
            return "", [], finish_reason
        content, calls, finish_reason = self.whole(self.text, finish_reason)
        rest = "" if calls or content is None else content[self.num_sent:]
        return rest, [{"index": i, **call} for i, call in enumerate(calls)], finish_reason

    def _required(self, text: str) -> list[dict]:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return []  # cut by max_tokens before the array closed
        return [_call(call["name"], call["parameters"]) for call in calls]

    @staticmethod
    def _hermes(text: str) -> tuple[str | None, list[dict]]:
        """vLLM's hermes parser's reading: the text before the first <tool_call> is the content, each tag's JSON one
        call; text whose tags do not hold valid calls is content as it is."""
        if HERMES_START not in text:
            return text, []
        calls = []
        for body in HERMES_CALL.findall(text):
            try:
                call = json.loads(body)
                calls.append(_call(call["name"], call.get("arguments", {})))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
        content = text[:text.find(HERMES_START)]
        return content or None, calls


def _partial_tag(text: str) -> int:
    """How many last characters of text could open a <tool_call> tag."""
    for size in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-size:]):
            return size
    return 0
