"""Answers from an OpenAI-compatible server (vLLM, SGLang, `draftheads serve`): one kept HTTP client, safe to share
between threads, that asks for chat completions and retries what may pass.

Token ids are asked for with vLLM's `return_token_ids` (the answer's ids in the choice, the prompt's beside the
choices); a server that refuses the field by name is asked without it from then on, and its answers come back as
text only. Refused connections, timeouts, 408, 409, 429 and 5xx are retried with exponential backoff a bounded
number of times; any other 4xx is the request's fault and fails at once. The context the server takes is read from
/v1/models where it says one (vLLM's `max_model_len` in each model's entry).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

RETRIED_STATUSES = (408, 409, 429)
MAX_BACKOFF_S = 30.0


class EndpointError(RuntimeError):
    """An endpoint failed for good: `status` is its last HTTP status (None when no response came)."""

    def __init__(self, message: str, status: int | None = None, reply: str = ""):
        super().__init__(message)
        self.status, self.reply = status, reply


@dataclass
class Answer:
    text: str
    finish_reason: str
    token_ids: list[int] | None  # as the server returned them (a stop token included), None when it sent text only
    prompt_token_ids: list[int] | None  # the prompt as the server rendered it, when it says


def base_url(url: str) -> str:
    """The server's root: the OpenAI API lives under /v1, which may be given or not."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


class Endpoint:
    def __init__(self, url: str, model: str | None = None, *, concurrency: int = 8, timeout_s: float = 600.0,
                 num_retries: int = 5, backoff_s: float = 1.0):
        self.url = base_url(url)
        self.num_retries, self.backoff_s = num_retries, backoff_s
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.Client(base_url=self.url, timeout=timeout_s, limits=limits)
        self.asks_token_ids = True
        self.num_retried = 0  # requests sent again after a failure that may pass, over the endpoint's life
        self._lock = threading.Lock()
        self.model, self.max_model_len = self._served_model(model)

    def close(self) -> None:
        self.client.close()

    def _served_model(self, model: str | None) -> tuple[str, int | None]:
        """(the model's name: `model`, else the first listed; the most tokens of prompt + answer it takes, where
        /v1/models says)."""
        listed = [entry for entry in self._send("GET", "/v1/models").get("data") or [] if isinstance(entry, dict)]
        if model is None:
            if not listed:
                raise EndpointError(f"{self.url}/v1/models lists no model: pass --endpoint-model NAME")
            model = listed[0]["id"]
        entry = next((entry for entry in listed if entry.get("id") == model), {})
        max_model_len = entry.get("max_model_len")
        return model, max_model_len if isinstance(max_model_len, int) and max_model_len > 0 else None

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, top_p: float, seed: int) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed}
        if self.asks_token_ids:
            try:
                return self._answer(self._send("POST", "/v1/chat/completions", {**body, "return_token_ids": True}))
            except EndpointError as error:
                if error.status != 400 or "return_token_ids" not in error.reply:
                    raise
                self.asks_token_ids = False
        return self._answer(self._send("POST", "/v1/chat/completions", body))

    def _answer(self, reply: dict) -> Answer:
        try:
            choice = reply["choices"][0]
            return Answer(choice["message"]["content"] or "", choice["finish_reason"], choice.get("token_ids"),
                          reply.get("prompt_token_ids"))
        except (KeyError, IndexError, TypeError) as error:
            raise EndpointError(f"{self.url}/v1/chat/completions answered with no chat completion (no {error}): "
                                f"{str(reply)[:300]}") from None

    def _send(self, method: str, path: str, body: dict | None = None) -> dict:
        """The response's JSON, after at most num_retries retries of what may pass; else an EndpointError."""
        for attempt in range(self.num_retries + 1):
            try:
                response = self.client.request(method, path, json=body)
            except httpx.TransportError as error:  # refused, reset, timed out
                problem, status = f"{type(error).__name__}: {error or 'no detail'}", None
            else:
                if response.is_success:
                    try:
                        return response.json()
                    except ValueError:
                        raise EndpointError(f"{self.url}{path} answered {response.status_code} with a body that is "
                                            f"not JSON: {response.text[:200]!r}") from None
                problem, status = f"HTTP {response.status_code}: {_reply(response)}", response.status_code
                if status < 500 and status not in RETRIED_STATUSES:
                    raise EndpointError(f"{self.url}{path} refused the request with {problem}", status, problem)
            if attempt < self.num_retries:
                time.sleep(min(MAX_BACKOFF_S, self.backoff_s * 2**attempt))
                with self._lock:
                    self.num_retried += 1
        raise EndpointError(f"{self.url}{path} failed {self.num_retries + 1} times (retried with backoff); the last "
                            f"time: {problem}", status, problem)


def says_too_long(error: EndpointError) -> bool:
    """Whether the endpoint refused a request for its length: a 400 whose message names the context length, as vLLM's
    ("This model's maximum context length is ...") and SGLang's do, or max_model_len, as `draftheads serve`'s does."""
    return error.status == 400 and any(words in error.reply.lower() for words in ("context length", "max_model_len"))


def _reply(response: httpx.Response) -> str:
    """What the server said: OpenAI's error message where it sent one, else the start of its body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return response.text[:500] or response.reason_phrase


