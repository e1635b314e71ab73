"""Answers the target did not generate in this process, laid out as a store's examples: token ids of the prompt
(rendered by the target's chat template) and of the answer, and a loss mask of 1 on the answer's tokens.

- `EndpointAnswers`: an OpenAI-compatible server's greedy or sampled answers to first turns, `concurrency` requests
  at a time on a thread pool. The answer's ids are the server's where it returns them, else its text tokenized
  with the target's tokenizer; an answer whose tokens do not decode back to its text is dropped, since no ids the
  target could have generated are known for it.
- `DatasetAnswers`: the prompt source's own assistant turns (ShareGPT's, as EAGLE-1 trained), each closed by the
  target's stop token as if the target had stopped there, cut at max_new_tokens.

Both yield (conversation id, outcome) pairs, an outcome being an example or why there is none: "too long" (the
prompt does not fit in max_model_len, or in the endpoint's context), "dropped" (see above), "unanswered" (the dataset
has no answer to the first turn) or "failed" (the endpoint refused the request, or failed it past its retries).
Multi-turn conversations are laid out as generate.py lays out the target's own: ids concatenated turn by turn.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from training.data.chat import prompt_ids, request_seed, stop_token_of, template_ids_after_answer, text_ids, user_turns
from training.data.endpoint import Answer, Endpoint, EndpointError, says_too_long


@dataclass(frozen=True)
class FailureLimits:
    """When examples the endpoint fails end the run: more than `share` of the examples it is asked for, or `in_a_row`
    failures one after another (the endpoint is down, or refuses every request)."""
    share: float = 0.05
    in_a_row: int = 20


class EndpointAnswers:
    """First turns answered by an endpoint. A request the endpoint refuses, or fails past its retries, is a "failed"
    outcome (its reason in `failures`) until the failures pass `limits`; then, or after an error that says the
    endpoint serves another target, no new request is sent, the requests in flight still come back, and `error`
    holds the reason for the caller to raise once those are stored. A prompt longer than the endpoint's context
    (its max_model_len at /v1/models, or a refusal that names the context length) is "too long"."""

    def __init__(self, endpoint: Endpoint, rows, tokenizer, eos_token_ids, *, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, max_len: int, concurrency: int, limits: FailureLimits = FailureLimits()):
        self.endpoint, self.tokenizer, self.eos_token_ids = endpoint, tokenizer, set(eos_token_ids)
        self.stop_token = stop_token_of(tokenizer, eos_token_ids)
        self.sampling = {"temperature": temperature, "top_p": top_p}
        self.max_new_tokens, self.seed, self.concurrency = max_new_tokens, seed, concurrency
        self.max_len = min(max_len, endpoint.max_model_len or max_len)
        self.rows, self.num_rows = iter(rows), len(rows)
        self.limits = limits
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="endpoint")
        self.in_flight: dict[Future, tuple[dict, list[int], int]] = {}  # -> row, prompt ids, max_tokens asked
        self.is_exhausted = False
        self.error: EndpointError | None = None
        self.failures: dict[str, str] = {}  # conversation id -> why the endpoint did not answer it
        self.num_failed_in_a_row = 0

    def is_done(self) -> bool:
        return not self.in_flight and (self.is_exhausted or self.error is not None)

    def poll(self, block: bool) -> list[tuple[str, dict | str]]:
        """The outcomes known now; with `block`, waits for at least one."""
        outcomes = self._send_more()
        if self.in_flight:
            done, _ = wait(self.in_flight, timeout=None if block and not outcomes else 0, return_when=FIRST_COMPLETED)
            for future in done:
                row, ids, max_tokens = self.in_flight.pop(future)
                try:
                    answer = future.result()
                except EndpointError as error:
                    outcomes.append((row["id"], self._failed(row["id"], error)))
                    continue
                self.num_failed_in_a_row = 0
                try:
                    outcomes.append((row["id"], self._example(row, ids, max_tokens, answer)))
                except EndpointError as error:
                    self.error = self.error or error
        return outcomes

    def _failed(self, conversation_id: str, error: EndpointError) -> str:
        """The outcome of a request the endpoint failed; sets `error` once the failures pass the limits."""
        if says_too_long(error):
            return "too long"
        self.failures[conversation_id] = str(error)
        self.num_failed_in_a_row += 1
        num_failed, limits = len(self.failures), self.limits
        if self.num_failed_in_a_row >= limits.in_a_row:
            why = f"{self.num_failed_in_a_row} requests failed in a row (the limit is {limits.in_a_row})"
        elif num_failed > limits.share * self.num_rows:
            why = (f"{num_failed} of the {self.num_rows} conversations asked for failed, more than the "
                   f"{limits.share:.0%} allowed")
        else:
            return "failed"
        if self.error is None:
            self.error = EndpointError(f"{why}; the last: {error}\n(--endpoint-failure-share and "
                                       "--endpoint-failures-in-a-row set when a run stops)", error.status, error.reply)
        return "failed"

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _send_more(self) -> list[tuple[str, str]]:
        """Keeps `concurrency` requests in flight, none queued: after an error, no request is sent."""
        too_long = []
        while self.error is None and not self.is_exhausted and len(self.in_flight) < self.concurrency:
            row = next(self.rows, None)
            if row is None:
                self.is_exhausted = True
                break
            messages = user_turns(row["messages"], "first")[0]
            ids = prompt_ids(self.tokenizer, messages)
            if len(ids) >= self.max_len:
                too_long.append((row["id"], "too long"))
                continue
            max_tokens = min(self.max_new_tokens, self.max_len - len(ids))
            seed = request_seed(self.seed, row["id"], 0)
            future = self.pool.submit(self.endpoint.chat, messages, max_tokens, seed=seed, **self.sampling)
            self.in_flight[future] = (row, ids, max_tokens)
        return too_long

    def _example(self, row: dict, ids: list[int], max_tokens: int, answer: Answer) -> dict | str:
        if answer.prompt_token_ids is not None and list(answer.prompt_token_ids) != ids:
            raise EndpointError(f"{self.endpoint.url} rendered the prompt of conversation {row['id']!r} as other "
                                "tokens than the target's chat template does: is it serving this target "
                                "(--endpoint-model)?")
        if answer.token_ids is not None:
            answer_ids, ids_from = list(answer.token_ids), "token_ids"
        else:
            answer_ids, ids_from = text_ids(self.tokenizer, answer.text), "text"
            if answer_ids is None:
                return "dropped"
        has_stop_token = bool(answer_ids) and answer_ids[-1] in self.eos_token_ids
        if answer.finish_reason == "stop" and self.stop_token is not None and not has_stop_token:
            answer_ids.append(self.stop_token)  # text (and some servers' ids) leave out the stop token generated
        answer_ids = answer_ids[:max_tokens]
        return {"id": row["id"], "category": row["category"], "input_ids": ids + answer_ids,
                "loss_mask": [0] * len(ids) + [1] * len(answer_ids), "ids_from": ids_from}


def answered_turns(messages: list[dict]) -> list[tuple[list[dict], str]]:
    """(the messages leading to an answer, ending with a user turn; the dataset's answer) per answered turn, in
    order, up to the first turn the dataset does not answer."""
    found, current = [], []
    for message in messages:
        if message["role"] != "assistant":
            current.append(message)
        elif current and current[-1]["role"] == "user":
            found.append((current, message["content"]))
            current = []
        else:
            break
    return found


class DatasetAnswers:
    """The source's own answers, `batch` conversations per poll. It never fails part way, so `error` stays None and
    `failures` empty."""

    error = None

    def __init__(self, rows, tokenizer, eos_token_ids, *, turns: str, max_new_tokens: int, max_len: int, batch: int):
        self.tokenizer, self.turns, self.batch = tokenizer, turns, batch
        self.max_new_tokens, self.max_len = max_new_tokens, max_len
        self.stop_token = stop_token_of(tokenizer, eos_token_ids)
        self.rows = iter(rows)
        self.is_exhausted = False
        self.failures: dict[str, str] = {}

    def is_done(self) -> bool:
        return self.is_exhausted

    def poll(self, block: bool) -> list[tuple[str, dict | str]]:
        outcomes = []
        for row in self.rows:
            outcomes.append((row["id"], self._example(row)))
            if len(outcomes) == self.batch:
                return outcomes
        self.is_exhausted = True
        return outcomes

    def close(self) -> None:
        pass

    def _example(self, row: dict) -> dict | str:
        turns = answered_turns(row["messages"])[:1 if self.turns == "first" else None]
        if not turns:
            return "unanswered"
        ids = prompt_ids(self.tokenizer, turns[0][0])
        if len(ids) >= self.max_len:
            return "too long"
        mask, history, stop_token = [0] * len(ids), [], None  # stop_token: the previous answer's, if it ended on one
        for i, (messages, text) in enumerate(turns):
            if i:
                template = template_ids_after_answer(self.tokenizer, history[:-1], messages, stop_token)
                if len(ids) + len(template) >= self.max_len:
                    break
                ids, mask = ids + template, mask + [0] * len(template)
            answer = text_ids(self.tokenizer, text)
            if answer is None:
                return "dropped"
            whole = answer + ([self.stop_token] if self.stop_token is not None else [])
            answer = whole[:min(self.max_new_tokens, self.max_len - len(ids))]
            stop_token = answer[-1] if len(answer) == len(whole) and self.stop_token is not None else None
            ids, mask = ids + answer, mask + [1] * len(answer)
            history += messages + [{"role": "assistant", "content": text}]
        return {"id": row["id"], "category": row["category"], "input_ids": ids, "loss_mask": mask, "ids_from": "text"}
