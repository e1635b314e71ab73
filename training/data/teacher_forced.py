"""Hidden states for answers generated elsewhere (an endpoint, or the dataset; training.data.answers): one
teacher-forced pass over each example's prompt + answer, by the capture backend `--capture` names
(training.data.capture: this project's engine, transformers or vLLM). The rows kept are those the in-process
generate keeps, one per token of input_ids. With no layers to store (`--layers none`) nothing runs the target, and
examples go to the store as they arrive.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from serving.config import DTYPES, resolve_device
from serving.targets import architecture, generation_limits
from training.data.answers import DatasetAnswers, EndpointAnswers, FailureLimits
from training.data.capture import (Capture, EngineCapture, NoCapture, TransformersCapture, find_vllm_python,
                                   resolve_capture)
from training.data.endpoint import Endpoint
from training.data.store import StoreWriter, tensor_keys
from training.data.vllm_capture import VllmCapture

OUTCOMES = ("too long", "dropped", "unanswered", "failed")


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
        eos_token_ids, max_position_embeddings = generation_limits(self.folder)
        # The engine's pass holds every token of an example and emits one more.
        max_len = min(config.max_model_len, max_position_embeddings - 1)
        if self.endpoint is None:
            source = DatasetAnswers(self.todo, tokenizer, eos_token_ids, turns=config.turns,
                                    max_new_tokens=config.max_new_tokens, max_len=max_len, batch=config.concurrency)
        else:
            source = EndpointAnswers(self.endpoint, self.todo, tokenizer, eos_token_ids,
                                     max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                     top_p=config.top_p, seed=config.seed, max_len=max_len,
                                     concurrency=config.endpoint_concurrency,
                                     limits=FailureLimits(config.endpoint_failure_share,
                                                          config.endpoint_failures_in_a_row))
        capture = self._capture(max_len)
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
            capture.close()
            self.failures = source.failures
            bar.close()
            self._note()
        if source.error is not None:
            raise source.error

    def _capture(self, max_len: int) -> Capture:
        config = self.config
        if not self.keys:
            return NoCapture()
        vllm_python = find_vllm_python(config.vllm_python)
        backend = resolve_capture(config.capture, architecture(self.folder), vllm_python)
        used = list(self.writer.stored.get("captured_by", []))
        self.writer.note("captured_by", used if backend in used else used + [backend])
        if backend == "engine":
            return EngineCapture(config.engine(self.folder, self.aux_layers, capture_hidden=True,
                                               max_model_len=max_len + 1), self.keys)
        if backend == "transformers":
            return TransformersCapture(self.folder, self.keys, self.aux_layers, dtype=DTYPES[config.dtype],
                                       device=resolve_device(config.device),
                                       max_batch_tokens=config.max_num_batched_tokens)
        return VllmCapture(vllm_python, self.folder, self.keys, self.aux_layers,
                           dtype=config.dtype, max_model_len=max_len + 1)

    def _note(self) -> None:
        self.writer.note("answer_ids", {**self.answer_ids, "dropped": list(self.answer_ids["dropped"])})

    def _store(self, example: dict, hidden: dict) -> None:
        num_answer = sum(example["loss_mask"])
        self.num_answer_tokens += num_answer
        self.answer_ids["num_token_ids" if example["ids_from"] == "token_ids" else "num_from_text"] += 1
        self._note()  # before add(), which may commit the example
        self.writer.add({"id": example["id"], "category": example["category"], "input_ids": example["input_ids"],
                         "loss_mask": example["loss_mask"], "hidden": hidden})
