"""Hidden states for answers generated elsewhere (an endpoint, or the dataset; training.data.answers): one
teacher-forced prefill pass of the engine over each example's prompt + answer.

Each example is a request whose prompt is all of its tokens, with max_tokens 1: the engine prefills it in chunks
(prefill speed, batched with the other examples), and a capturing engine then runs the one emitted token too, whose
row is dropped. The rows kept are those the in-process generate keeps, one per token of input_ids. With no layers
to store (`--layers none`) there is no engine, and examples go to the store as they arrive.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from serving.engine import Engine
from serving.model import ModelConfig
from serving.request import SamplingParams
from training.data.answers import DatasetAnswers, EndpointAnswers, FailureLimits
from training.data.endpoint import Endpoint
from training.data.store import HIDDEN_DTYPE, StoreWriter, tensor_keys

OUTCOMES = ("too long", "dropped", "unanswered", "failed")


class Capture:
    """Examples in, (example, hidden {store key: [T, hidden]}) out, as their passes finish."""

    def __init__(self, engine: Engine | None, keys: list[str]):
        self.engine, self.keys = engine, keys
        self.active: dict[str, dict] = {}  # request id (the example's id) -> example

    def add(self, example: dict) -> None:
        self.active[example["id"]] = example
        if self.engine is not None:
            self.engine.add_request(example["input_ids"], SamplingParams(max_tokens=1, temperature=0.0),
                                    request_id=example["id"])

    def has_unfinished(self) -> bool:
        return bool(self.active)

    def step(self) -> list[tuple[dict, dict]]:
        if self.engine is None:
            done = [(example, {}) for example in self.active.values()]
            self.active = {}
            return done
        done = []
        for output in self.engine.step():
            example = self.active.pop(output.request_id)
            rows = slice(0, len(example["input_ids"]))  # the emitted token's row is not the example's
            captured = {"last": output.hidden[rows], **{f"aux.{i}": h[rows] for i, h in output.aux.items()}}
            done.append((example, {key: captured[key].to(HIDDEN_DTYPE) for key in self.keys}))
        return done


class TeacherForcedGeneration:
    """One run over the conversations a store does not hold yet, answered by `endpoint` (None: by the dataset).

    meta.json's "answer_ids" note says how the stored answers' ids were obtained: num_token_ids (as the endpoint
    returned them), num_from_text (text tokenized with the target's tokenizer) and `dropped`, the conversations
    whose answer text does not tokenize back to itself, which a rerun does not ask for again."""

    def __init__(self, config, folder: Path, aux_layers: tuple[int, ...], writer: StoreWriter, rows,
                 endpoint: Endpoint | None):
        self.config, self.folder, self.aux_layers, self.writer = config, folder, aux_layers, writer
        self.endpoint = endpoint
        self.keys = tensor_keys(config.layers, aux_layers)
        self.num_rows = len(rows)
        noted = writer.stored.get("answer_ids", {})
        self.answer_ids = {"num_token_ids": noted.get("num_token_ids", 0),
                           "num_from_text": noted.get("num_from_text", 0), "dropped": list(noted.get("dropped", []))}
        skipped = writer.done_ids | set(self.answer_ids["dropped"])
        self.todo = [row for row in rows if row["id"] not in skipped]
        self.outcomes = Counter()
        self.failures: dict[str, str] = {}  # conversation id -> why the endpoint did not answer it; a rerun asks again
        self.num_answer_tokens = 0
        self.elapsed_s = 0.0

    @property
    def num_skipped(self) -> int:
        return self.outcomes["too long"]

    def run(self, progress: bool) -> None:
        if not self.todo:
            return
        config = self.config
        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        if not tokenizer.chat_template:
            raise ValueError(f"target {config.target} has no chat template: generate renders chat prompts")
        model = ModelConfig.from_folder(self.folder)
        # The pass's request holds every token of an example and emits one more.
        max_len = min(config.max_model_len, model.max_position_embeddings - 1)
        if self.endpoint is None:
            source = DatasetAnswers(self.todo, tokenizer, model.eos_token_ids, turns=config.turns,
                                    max_new_tokens=config.max_new_tokens, max_len=max_len, batch=config.concurrency)
        else:
            source = EndpointAnswers(self.endpoint, self.todo, tokenizer, model.eos_token_ids,
                                     max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                     top_p=config.top_p, seed=config.seed, max_len=max_len,
                                     concurrency=config.endpoint_concurrency,
                                     limits=FailureLimits(config.endpoint_failure_share,
                                                          config.endpoint_failures_in_a_row))
        engine = None
        if self.keys:
            engine = config.engine(self.folder, self.aux_layers, capture_hidden=True, max_model_len=max_len + 1)
        capture = Capture(engine, self.keys)
        bar = tqdm(total=self.num_rows, initial=self.num_rows - len(self.todo), desc="prompts", unit="prompt",
                   disable=not progress)
        start = time.perf_counter()
        try:
            while not source.is_done() or capture.has_unfinished():
                for conversation_id, outcome in source.poll(block=not capture.has_unfinished()):
                    if isinstance(outcome, dict):
                        capture.add(outcome)
                        continue
                    self.outcomes[outcome] += 1
                    if outcome == "dropped":
                        self.answer_ids["dropped"].append(conversation_id)
                    bar.update(1)
                for example, hidden in capture.step():
                    self._store(example, hidden)
                    bar.update(1)
                self.elapsed_s = time.perf_counter() - start
        finally:
            source.close()
            self.failures = source.failures
            bar.close()
            self._note()
        if source.error is not None:
            raise source.error

    def _note(self) -> None:
        self.writer.note("answer_ids", {**self.answer_ids, "dropped": list(self.answer_ids["dropped"])})

    def _store(self, example: dict, hidden: dict) -> None:
        num_answer = sum(example["loss_mask"])
        self.num_answer_tokens += num_answer
        self.answer_ids["num_token_ids" if example["ids_from"] == "token_ids" else "num_from_text"] += 1
        self._note()  # before add(), which may commit the example
        self.writer.add({"id": example["id"], "category": example["category"], "input_ids": example["input_ids"],
                         "loss_mask": example["loss_mask"], "hidden": hidden})
