"""The engine loop: one thread owns the engine and steps it while requests are in flight. The HTTP handlers
reach it only through an inbox (new requests, aborts, calls) and per-request streams of events, so the engine is
never touched from two threads.

Between steps the loop empties the inbox, so a request joins the running batch at the next step after it arrives
(continuous batching); with nothing in flight it sleeps on the inbox. The samples of one request (OpenAI's n) are
sequences of their own over the same prompt: the first joins at once, the others once the first has computed its
prompt, whose full blocks the prefix cache then shares with them (no prompt is computed twice). After each step
every in-flight request's stream gets the tokens emitted to it since the last step; a finished request's last ones
come with its RequestOutput. A step that raises fails every request in flight (they are aborted, their clients get
a 500) and the loop goes on serving. Draining (on SIGTERM) refuses new requests and gives those in flight until a
deadline, then fails them with a 503, so every response still ends properly.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from serving.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Accepted:
    num_prompt_tokens: int


@dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class Finished:
    output: RequestOutput
    token_ids: list[int]  # emitted in the last step, not sent before
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class Failed:
    status: int
    message: str


class Stream:
    """One request's events: written by the engine thread, read by the handler on its event loop."""

    def __init__(self, request_id: str, event_loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.events: asyncio.Queue = asyncio.Queue()
        self.event_loop = event_loop
        self.arrival_time = time.perf_counter()
        self.last_token_time: float | None = None
        self.num_sent = 0

    def put(self, event) -> None:
        try:
            self.event_loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop closed: nobody is listening any more
            pass

    async def get(self):
        return await self.events.get()


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}
        self.siblings: dict[str, tuple[list[int], list]] = {}  # first sample's id -> (prompt, [(stream, params)])
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # OpenMP's thread count is per calling thread: the engine thread takes the one set where the engine was built.
        self.num_threads = torch.get_num_threads()
        self.closed = False  # set once the loop has ended; the lock orders it against submissions
        self.drain_deadline: float | None = None  # engine thread only
        self._lock = threading.Lock()

    # ---- from the handlers' threads -------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def submit(self, prompt_ids: list[int], samples: list[tuple[str, SamplingParams]]) -> list[Stream]:
        """Queues a request's samples, (request id, params) each, over one prompt; each stream first says Accepted or
        Failed."""
        streams = [Stream(request_id, asyncio.get_running_loop()) for request_id, _ in samples]
        with self._lock:
            if self.closed:
                for stream in streams:
                    stream.put(Failed(503, "the server is shutting down"))
            else:
                self.inbox.put(("add", streams[0], prompt_ids, samples[0][1]))
                if len(samples) > 1:
                    self.inbox.put(("siblings", samples[0][0], prompt_ids,
                                    [(stream, params) for stream, (_, params) in zip(streams[1:], samples[1:])]))
        return streams

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def call(self, function) -> concurrent.futures.Future:
        """Runs function(engine) in the engine thread between steps; its result comes back in the future."""
        future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                future.set_exception(RuntimeError("the engine loop has stopped"))
            else:
                self.inbox.put(("call", function, future))
        return future

    def drain(self, timeout: float) -> None:
        """From now on new requests are refused; those in flight fail after `timeout` seconds. Safe to call from a
        signal handler (SimpleQueue.put is reentrant)."""
        self.inbox.put(("drain", time.perf_counter() + timeout))

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still in flight and ends the thread."""
        if self.thread.is_alive():
            self.inbox.put(("stop",))
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.error("the engine loop did not stop within %.0f s", timeout)

    # ---- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            while self._take_inbox(wait=not self.engine.has_unfinished() and not self.siblings):
                self._add_siblings()
                if self.drain_deadline is not None and time.perf_counter() >= self.drain_deadline and self.streams:
                    self._fail_all(503, "the server shut down before this request finished")
                if not self.engine.has_unfinished():
                    continue
                try:
                    self._publish(self.engine.step())
                except Exception:
                    log.exception("an engine step failed; failing every request in flight")
                    self._fail_all(500, "the engine failed while serving this request; see the server's log")
        finally:
            self._fail_all(503, "the server is shutting down")
            self._refuse_inbox()

    def _take_inbox(self, wait: bool) -> bool:
        """Handles what the inbox holds (waiting for one item if `wait`); False once told to stop."""
        items = [self.inbox.get()] if wait else []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*item[1:])
            elif kind == "siblings":
                self.siblings[item[1]] = (item[2], item[3])
            elif kind == "drain":
                self.drain_deadline = min(item[1], self.drain_deadline or item[1])
            elif kind == "abort":
                self.streams.pop(item[1], None)
                self.siblings.pop(item[1], None)
                for _, waiting in self.siblings.values():
                    waiting[:] = [(stream, params) for stream, params in waiting if stream.request_id != item[1]]
                self.engine.abort(item[1])
            elif kind == "call":
                function, future = item[1:]
                try:
                    future.set_result(function(self.engine))
                except Exception as error:
                    future.set_exception(error)
        if items and self.metrics:
            self.metrics.update_engine(self.engine)
        return True

    def _add_siblings(self) -> None:
        """Adds the other samples of each request whose first sample has computed its prompt (or left)."""
        for first_id, (prompt_ids, waiting) in list(self.siblings.items()):
            first = self.engine.requests.get(first_id)
            if first is not None and first.num_computed_tokens < first.num_prompt_tokens:
                continue
            del self.siblings[first_id]
            for stream, params in waiting:
                self._add(stream, prompt_ids, params)

    def _add(self, stream: Stream, prompt, params: SamplingParams) -> None:
        if self.drain_deadline is not None:
            stream.put(Failed(503, "the server is shutting down"))
            return
        try:
            self.engine.add_request(prompt, params, stream.request_id)
        except ValueError as error:
            stream.put(Failed(400, str(error)))
            return
        except Exception as error:  # a bug, not bad input: the request fails, the loop goes on
            log.exception("adding request %s failed", stream.request_id)
            stream.put(Failed(500, f"the engine could not take this request: {type(error).__name__}: {error}"))
            return
        num_prompt_tokens = self.engine.requests[stream.request_id].num_prompt_tokens
        self.streams[stream.request_id] = stream
        if self.metrics:
            self.metrics.of(self.metrics.prompt_tokens).inc(num_prompt_tokens)
        stream.put(Accepted(num_prompt_tokens))

    def _publish(self, finished: list[RequestOutput]) -> None:
        """Hands each stream its new tokens, after the metrics count them: a client that reads /metrics once its
        answer is whole sees every step of it."""
        now = time.perf_counter()
        outputs = {output.request_id: output for output in finished}
        num_emitted, events = 0, []
        for request_id, stream in list(self.streams.items()):
            output = outputs.get(request_id)
            if output is not None:
                new = output.token_ids[stream.num_sent:]
                logprobs = output.logprobs[stream.num_sent:] if output.logprobs is not None else None
                top = output.top_logprobs[stream.num_sent:] if output.top_logprobs is not None else None
            else:
                request = self.engine.requests[request_id]
                new = request.token_ids[request.num_prompt_tokens + stream.num_sent:]
                logprobs = request.logprobs[stream.num_sent:] if request.params.logprobs else None
                top = request.top_logprobs[stream.num_sent:] if request.params.top_logprobs else None
            if new:
                num_emitted += len(new)
                stream.num_sent += len(new)
                self._observe_tokens(stream, now)
                if output is None:
                    events.append((stream, Tokens(new, logprobs, top)))
            if output is not None:
                del self.streams[request_id]
                events.append((stream, Finished(output, new, logprobs, top)))
                if self.metrics:
                    self.metrics.of(self.metrics.e2e_request_latency).observe(now - stream.arrival_time)
                    self.metrics.of(self.metrics.request_success, finished_reason=output.finish_reason).inc()
        if self.metrics:
            self.metrics.of(self.metrics.generation_tokens).inc(num_emitted)
            self.metrics.update_engine(self.engine)
        for stream, event in events:
            stream.put(event)

    def _observe_tokens(self, stream: Stream, now: float) -> None:
        if self.metrics:
            if stream.last_token_time is None:
                self.metrics.of(self.metrics.time_to_first_token).observe(now - stream.arrival_time)
            else:
                self.metrics.of(self.metrics.inter_token_latency).observe(now - stream.last_token_time)
        stream.last_token_time = now

    def _refuse_inbox(self) -> None:
        """After the loop ends: requests and calls still queued get an answer instead of waiting forever."""
        with self._lock:
            self.closed = True
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                item[1].put(Failed(503, "the server is shutting down"))
            elif item[0] == "siblings":
                for stream, _ in item[3]:
                    stream.put(Failed(503, "the server is shutting down"))
            elif item[0] == "call":
                item[2].set_exception(RuntimeError("the engine loop has stopped"))

    def _fail_all(self, status: int, message: str) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        for stream in self.streams.values():
            stream.put(Failed(status, message))
        self.streams.clear()
        for _, waiting in self.siblings.values():
            for stream, _ in waiting:
                stream.put(Failed(status, message))
        self.siblings.clear()
        if self.metrics:
            self.metrics.update_engine(self.engine)
