"""The HTTP API: OpenAI's chat and text completions (whole or streamed as server-sent events), the model list,
health and Prometheus metrics, over one engine loop (serving.server.loop).

A handler parses and checks the body (serving.server.protocol), renders the prompt with a tokenizer of its own
(the engine's belongs to the engine thread), refuses what the context cannot hold, and queues the request. It
answers only once the engine accepted the request, so every refusal is an HTTP status with OpenAI's error object.
A client that goes away (a closed stream, or a dropped connection while waiting for a whole answer) aborts its
request, which frees its blocks at the next step boundary. A request for n choices runs n sequences (the loop adds
them so that they share the prompt's blocks); their events are merged into one answer, choice i from sequence i.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serving.engine import Engine, encode
from serving.server.detokenizer import Detokenizer
from serving.server.loop import Accepted, EngineLoop, Failed, Finished, Stream, Tokens
from serving.server.metrics import ServerMetrics
from serving.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from serving.server.tools import ToolCalls, tool_call_parser
from serving.spec_decode.metrics import AcceptanceStats

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a handler waiting for a whole answer checks that its client is still there


def build_app(engine: Engine, model_name: str) -> FastAPI:
    """The app over `engine`; its lifespan starts and stops the engine loop (`app.state.engine_loop`)."""
    metrics = ServerMetrics(model_name)
    metrics.update_engine(engine)  # before the loop starts: every counter shows from the first scrape
    loop = EngineLoop(engine, metrics)
    api = OpenAIServer(engine, loop, metrics, model_name)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="draftheads", description="OpenAI-compatible API over the draftheads speculative engine",
                  lifespan=lifespan)
    app.state.engine_loop, app.state.metrics = loop, metrics
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(_, error: Exception):
        log.exception("unexpected error while serving a request")
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}: {error}").body(), status_code=500)

    return app


class OpenAIServer:
    def __init__(self, engine: Engine, loop: EngineLoop, metrics: ServerMetrics, model_name: str):
        self.engine, self.loop, self.metrics, self.model_name = engine, loop, metrics, model_name
        self.created = int(time.time())
        self.tokenizer = None
        if engine.tokenizer is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(engine.folder)
        self.tool_call_parser = tool_call_parser(self.tokenizer.chat_template if self.tokenizer else None)

    # ---- routes -------------------------------------------------------------------------------------

    async def chat(self, request: Request):
        body = parse(ChatCompletionRequest, await _json(request))
        self._check_model(body.model)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        prompt_ids = self._encode([message.to_engine() for message in body.messages], tools)
        reply = Reply(self.model_name, chat=True, with_token_ids=body.return_token_ids)
        if body.tool_mode != "none":
            reply.tool_calls = [ToolCalls(body.tool_mode, body.tool_choice, self.tool_call_parser)
                                for _ in range(body.n)]
        return await self._serve(request, body, prompt_ids, reply, body.logprobs, body.top_logprobs or 0)

    async def completions(self, request: Request):
        body = parse(CompletionRequest, await _json(request))
        self._check_model(body.model)
        prompt_ids = self._encode(body.prompt)
        reply = Reply(self.model_name, chat=False, with_token_ids=body.return_token_ids)
        if body.echo:  # the prompt as given, or its token ids decoded
            reply.echo = Echo(body.prompt if isinstance(body.prompt, str) else self._decode(prompt_ids),
                              answer=body.max_tokens != 0)
        return await self._serve(request, body, prompt_ids, reply, body.logprobs is not None, body.logprobs or 0,
                                 body.prompt_logprobs_asked)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "draftheads", "root": str(self.engine.folder),
                                            "max_model_len": self.engine.max_model_len}]}

    async def health(self):
        if not self.loop.thread.is_alive():
            raise APIError(503, "the engine loop is not running")
        return Response(status_code=200)

    async def prometheus(self):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # ---- one request --------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def _encode(self, prompt, tools: list[dict] | None = None) -> list[int]:
        """The engine's own rendering (serving.engine.encode), run with this thread's tokenizer."""
        try:
            return encode(self.tokenizer, prompt, self.engine.folder, tools)
        except ValueError as error:
            raise APIError(400, str(error), "messages" if isinstance(prompt, list) and prompt else "prompt") from None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _max_tokens(self, body: SamplingFields, num_prompt_tokens: int) -> int:
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens but max_model_len is {limit}: shorten it "
                                f"to at most {limit - 1} tokens",
                           "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                           "context_length_exceeded")
        asked, name = body.requested_max_tokens
        if asked is None:
            return limit - num_prompt_tokens
        if asked >= 1 and num_prompt_tokens + asked > limit:
            pool = self.engine.block_manager.num_blocks * self.engine.block_size
            raise APIError(400, f"{name}={asked} after a prompt of {num_prompt_tokens} tokens needs "
                                f"{num_prompt_tokens + asked} tokens of context, but this server holds at most "
                                f"max_model_len={limit} per request (its K/V pool holds {pool} tokens in all): ask "
                                f"for at most {limit - num_prompt_tokens}", name, "context_length_exceeded")
        return asked

    async def _serve(self, request: Request, body: SamplingFields, prompt_ids: list[int], reply: "Reply",
                     logprobs: bool, top_logprobs: int, prompt_logprobs: int | None = None):
        samples = body.samples(self._max_tokens(body, len(prompt_ids)), logprobs, top_logprobs, prompt_logprobs)
        ids = [reply.request_id] if len(samples) == 1 else [f"{reply.request_id}-{i}" for i in range(len(samples))]
        streams = self.loop.submit(prompt_ids, list(zip(ids, samples)))
        try:
            first = await streams[0].get()
        except asyncio.CancelledError:
            self._abort(ids)
            raise
        if isinstance(first, Failed):
            self._abort(ids[1:])
            raise APIError(first.status, first.message)
        assert isinstance(first, Accepted), first
        usage = Usage(first.num_prompt_tokens, self.engine.speculator is not None)
        events = Samples(streams)
        if body.stream:
            detokenizers = [Detokenizer(self.tokenizer, samples[0].stop) if self.tokenizer is not None else None
                            for _ in samples]
            return StreamingResponse(self._events(events, ids, reply, detokenizers, usage, body.include_usage),
                                     media_type="text/event-stream")
        return await self._whole(request, events, ids, reply, usage)

    def _abort(self, ids: list[str]) -> None:
        for request_id in ids:
            self.loop.abort(request_id)

    async def _whole(self, request: Request, events: "Samples", ids: list[str], reply: "Reply", usage: "Usage"):
        outputs: dict[int, object] = {}
        try:
            while len(outputs) < len(ids):
                try:
                    index, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if isinstance(event, Failed):
                    raise APIError(event.status, event.message)
                if isinstance(event, Finished):
                    outputs[index] = event.output
            outputs = [outputs[i] for i in range(len(ids))]
            logprobs = [reply.logprobs(self.tokenizer, *reply.scored(o)) for o in outputs]
            prompt_logprobs = None if outputs[0].prompt_logprobs is None else \
                reply.prompt_logprobs(self.tokenizer, outputs[0].prompt_token_ids, outputs[0].prompt_logprobs)
            return reply.whole(outputs, logprobs, usage.of(outputs), prompt_logprobs)
        finally:
            events.close()
            if len(outputs) < len(ids):
                self._abort(ids)

    async def _events(self, events: "Samples", ids: list[str], reply: "Reply", detokenizers: list,
                      usage: "Usage", include_usage: bool):
        """Server-sent events: OpenAI's chunks, each choice's last with its finish reason, usage if asked, then
        [DONE]."""
        outputs: dict[int, object] = {}
        failed = False
        try:
            if reply.chat:
                for index in range(len(ids)):
                    yield _sse(reply.chunk(role="assistant", text="", index=index))
            while len(outputs) < len(ids) and not failed:
                index, event = await events.get()
                detokenizer = detokenizers[index]
                if isinstance(event, Tokens):
                    text = detokenizer.add(event.token_ids) if detokenizer else ""
                    text, calls = reply.tool_calls[index].delta(text) if reply.tool_calls else (text, [])
                    logprobs = reply.logprobs(self.tokenizer, event.token_ids, event.logprobs, event.top_logprobs)
                    if text or logprobs or calls:
                        yield _sse(reply.chunk(text=text, logprobs=logprobs, index=index, tool_calls=calls))
                elif isinstance(event, Finished):
                    outputs[index] = event.output
                    text, calls, finish_reason = "", [], event.output.finish_reason
                    if detokenizer:
                        text = detokenizer.add(event.token_ids) + detokenizer.finish(event.output.text)
                    if reply.tool_calls:
                        text, calls = reply.tool_calls[index].delta(text)
                        rest, calls_left, finish_reason = reply.tool_calls[index].finish(finish_reason)
                        text, calls = text + rest, calls + calls_left
                    logprobs = reply.logprobs(self.tokenizer, event.token_ids, event.logprobs, event.top_logprobs)
                    yield _sse(reply.chunk(text=text, finish_reason=finish_reason, logprobs=logprobs, index=index,
                                           tool_calls=calls))
                elif isinstance(event, Failed):
                    failed = True
                    yield _sse(APIError(event.status, event.message).body())
            if include_usage and not failed:
                yield _sse(reply.usage_chunk(usage.of([outputs[i] for i in range(len(ids))])))
            yield "data: [DONE]\n\n"
        finally:
            events.close()
            if len(outputs) < len(ids):  # the client went away (starlette cancels the stream), the server is
                self._abort(ids)  # stopping, or a sample failed: the others stop too


class Samples:
    """The events of a request's samples (one stream each) as (index, event), in the order they come."""

    def __init__(self, streams: list[Stream]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(index, stream)) for index, stream in enumerate(streams)]

    async def _pump(self, index: int, stream: Stream) -> None:
        while True:
            event = await stream.get()
            if not isinstance(event, Accepted):
                self.queue.put_nowait((index, event))
            if isinstance(event, (Finished, Failed)):
                return

    async def get(self):
        return await self.queue.get()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


class Usage:
    def __init__(self, num_prompt_tokens: int, speculating: bool):
        self.num_prompt_tokens, self.speculating = num_prompt_tokens, speculating

    def of(self, outputs: list) -> dict:
        """The prompt once, the samples' completions summed; acceptance summed over the samples, and per sample in
        `speculative.samples` when there are several."""
        num_completion = sum(len(output.token_ids) for output in outputs)
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": num_completion,
                 "total_tokens": self.num_prompt_tokens + num_completion}
        if self.speculating:  # a request served plain (penalties) reports zero drafts
            per_sample = [output.metrics.get("spec") or AcceptanceStats().to_dict() for output in outputs]
            total = AcceptanceStats()
            for stats in per_sample:
                total.merge(AcceptanceStats.from_dict(stats))
            usage["speculative"] = per_sample[0] if len(outputs) == 1 else {**total.to_dict(), "samples": per_sample}
        return usage


@dataclass
class Echo:
    """A text completion's echoed prompt: its text, and whether the answer follows (max_tokens 0: the prompt only)."""
    text: str
    answer: bool


class Reply:
    """The shape of one answer: a chat completion or a text completion, whole or as chunks."""

    def __init__(self, model: str, chat: bool, with_token_ids: bool = False):
        self.model, self.chat, self.with_token_ids = model, chat, with_token_ids
        self.echo: Echo | None = None  # a text completion that echoes its prompt
        self.request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.tool_calls: list[ToolCalls] | None = None  # per choice, when the request reads tool calls
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, outputs: list, logprobs: list, usage: dict, prompt_logprobs: list | None = None) -> dict:
        choices = []
        for index, (output, output_logprobs) in enumerate(zip(outputs, logprobs)):
            choice = {"index": index, "logprobs": output_logprobs, "finish_reason": output.finish_reason}
            text = output.text
            if self.echo:
                text = self.echo.text + (text if self.echo.answer else "")
            if prompt_logprobs is not None:  # vLLM's extra field, in every choice
                choice["prompt_logprobs"] = prompt_logprobs
            if self.tool_calls:
                content, calls, choice["finish_reason"] = self.tool_calls[index].whole(text, output.finish_reason)
                choice["message"] = {"role": "assistant", "content": content,
                                     **({"tool_calls": calls} if calls else {})}
            else:
                choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            if self.with_token_ids:  # vLLM's layout: the answer's ids (a stop token included) in the choice
                choice["token_ids"] = list(output.token_ids)
            choices.append(choice)
        if not self.with_token_ids:
            return {**self._envelope(self.object, choices), "usage": usage}
        # vLLM's layout: the prompt's ids beside the choices
        prompt_token_ids = list(outputs[0].prompt_token_ids)
        return {**self._envelope(self.object, choices), "prompt_token_ids": prompt_token_ids, "usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None, logprobs=None, role: str | None = None,
              index: int = 0, tool_calls: list[dict] | None = None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": role, "content": text} if role else ({"content": text} if text else {})
            if tool_calls:
                choice["delta"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope("chat.completion.chunk" if self.chat else "text_completion", []), "usage": usage}

    def scored(self, output) -> tuple[list[int], list | None, list | None]:
        """(token ids, their logprobs, their alternatives) that a whole answer's logprobs object covers: the answer's,
        after the prompt's when echoing (the first prompt token's logprob is None: nothing comes before it)."""
        if not self.echo or output.logprobs is None:
            return output.token_ids, output.logprobs, output.top_logprobs
        prompt = output.prompt_logprobs
        answer = self.echo.answer
        token_ids = list(output.prompt_token_ids) + (list(output.token_ids) if answer else [])
        logprobs = [None if p is None else p[0] for p in prompt] + (list(output.logprobs) if answer else [])
        top = [None if p is None else p[2] for p in prompt] + (list(output.top_logprobs or [[]] * len(
            output.token_ids)) if answer else [])
        return token_ids, logprobs, top

    def prompt_logprobs(self, tokenizer, token_ids: list[int], logprobs: list) -> list:
        """vLLM's prompt_logprobs: per prompt token None (the first), else {token id: {logprob, rank, decoded_token}}
        for the prompt token, then its row's likeliest."""
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
        entries = [None]
        for token, scored in zip(token_ids[1:], logprobs[1:]):
            logprob, rank, likeliest = scored
            entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": decode(token)}}
            for r, (t, lp) in enumerate(likeliest, start=1):
                entry.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": decode(t)})
            entries.append(entry)
        return entries

    def logprobs(self, tokenizer, token_ids: list[int], logprobs: list[float | None] | None,
                 top: list[list[tuple[int, float]] | None] | None):
        """OpenAI's logprobs object for these tokens, with each one's most likely alternatives where asked (`top`);
        None when no logprobs were asked. An echoed prompt's first token has neither (None)."""
        if logprobs is None:
            return None
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
        tokens = [decode(t) for t in token_ids]
        top = top or [[] for _ in token_ids]
        if self.chat:
            return {"content": [
                {"token": token, "logprob": logprob, "bytes": list(token.encode()),
                 "top_logprobs": [{"token": decode(t), "logprob": lp, "bytes": list(decode(t).encode())}
                                  for t, lp in alternatives]}
                for token, logprob, alternatives in zip(tokens, logprobs, top)]}
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        # the completions API's alternatives: the sampled token's and the most likely ones' logprobs by text, as vLLM's
        tops = [None if logprob is None else {**{decode(t): lp for t, lp in alternatives}, token: logprob}
                for token, logprob, alternatives in zip(tokens, logprobs, top)] if any(top) else None
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}") from None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
