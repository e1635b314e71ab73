"""`draftheads generate`: the frozen target answers prompts in the paged engine, and the same pass yields the
hidden states a draft head trains on; both go to a self-distilled store (see store.py).

Conversations run under continuous batching, `concurrency` at a time. With `--turns first` the target answers
the first user turn; with `--turns all` it answers every user turn in order, each conditioned on its own
earlier answers (the dataset's answers are dropped). The request for the next turn is the previous request's
token ids, the generated ids, and the chat template's tokens for the next user turn, concatenated as ids:
retokenising generated text can change them. The engine captures hidden states for every token of a request,
so the last request of a conversation carries them for all of it: "last", the final hidden state after the
final norm, and "eagle3", the input of each aux layer (default 2, L//2, L-3). Finished conversations are
committed a shard at a time; rerunning the same command skips them and redoes the rest.

Answers may also come from elsewhere (training.data.answers): from any OpenAI-compatible server (`--endpoint URL`,
first turns) or from the prompt source's own assistant turns (`--answers dataset`); the engine then captures their
hidden states in one teacher-forced prefill pass (training.data.teacher_forced). meta.json's "answers" names the
source. `--layers none` stores token ids only, for training online.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from tqdm.auto import tqdm

from serving import targets
from serving.attention import KVCache
from serving.config_file import CONFIG_HELP, add_options, merge_options
from serving.config import DTYPES, HELP as ENGINE_HELP, WEIGHTS, EngineConfig, resolve_device
from serving.engine import Engine
from serving.model import ModelConfig
from serving.bench.prompts import load_prompts
from serving.request import SamplingParams
from training.data.capture import CAPTURES
from training.data.chat import request_seed, template_ids_after_answer, user_turns
from training.data.endpoint import Endpoint, EndpointError
from training.data.store import HIDDEN_DTYPE, LAYERS, StoreWriter, tensor_keys
from training.data.teacher_forced import TeacherForcedGeneration

TURNS = ("first", "all")
ANSWERS = ("target", "dataset")
HELP = {
    "config": CONFIG_HELP,
    "target": "target: a built-in name, a local Hugging Face folder or a hub id",
    "prompts": "prompt source: sharegpt, sharegpt-heldout, mt-bench, humaneval, or a JSONL file",
    "num_prompts": "answer the first N conversations of the source (default: all)",
    "max_new_tokens": "most tokens per answer",
    "temperature": "sampling temperature; 0 is greedy",
    "top_p": "nucleus sampling mass",
    "structured_outputs": "constrain every answer generated here, as vLLM's structured_outputs: JSON with one of json "
                          "(a schema), json_object, regex, choice, grammar, e.g. '{\"json_object\": true}'",
    "seed": "sampling seed; each request draws from a seed derived from it, the conversation id and the turn",
    "layers": "hidden states to store, comma-separated: last (after the final norm), eagle3 (three aux layers); "
              "none stores token ids only, for a head trained online (data.mode: online)",
    "aux_layers": "EAGLE-3 aux layer ids, comma-separated, low to high, each the input of that layer (default: 2,L//2,L-3)",
    "turns": "first: answer the first user turn; all: answer every user turn, conditioned on the earlier answers",
    "concurrency": "conversations answered at once (the engine's max_num_seqs)",
    "max_model_len": "most tokens in a conversation; a longer first turn is skipped, a longer conversation ends early",
    "max_num_batched_tokens": ENGINE_HELP["max_num_batched_tokens"],
    "shard_size": "examples per shard of hidden states; a shard is the unit of commit and resume",
    "dtype": "the target's compute dtype (hidden states are stored in bfloat16)",
    "weights": ENGINE_HELP["weights"],
    "device": ENGINE_HELP["device"],
    "out": "the store folder; rerunning into it resumes",
    "answers": "target: the target answers each prompt, in this process (hidden states captured in the same pass) "
               "or at --endpoint; dataset: the prompt source's own assistant turns (ShareGPT's), nothing generated. "
               "Answers from an endpoint or the dataset get their hidden states from one teacher-forced prefill pass "
               "of the engine over prompt + answer",
    "endpoint": "base URL of an OpenAI-compatible server (vLLM, SGLang, draftheads serve) serving the target, e.g. "
                "http://127.0.0.1:8000: it answers the first turns through /v1/chat/completions, as token ids where it "
                "returns them (vLLM's return_token_ids), else as text tokenized here (an answer whose tokens do not "
                "decode back to its text is dropped, and not asked again)",
    "endpoint_model": "the model name the endpoint serves the target under (default: the first at /v1/models)",
    "endpoint_concurrency": "requests the endpoint answers at once",
    "endpoint_retries": "retries of a request after a refused connection, a timeout or HTTP 408/409/429/5xx, with "
                        "backoff 1, 2, 4, ... s; then the conversation counts as failed (a rerun asks for it again)",
    "endpoint_failure_share": "generate stops, keeping what it stored, once more than this share of the conversations "
                              "it asks the endpoint for failed (refused, or failed past the retries); prompts longer "
                              "than the endpoint's context are skipped as too long, not failed",
    "endpoint_failures_in_a_row": "generate stops, keeping what it stored, after this many failed requests in a row",
    "endpoint_timeout": "seconds one request may take",
    "capture": "what computes the hidden states of answers from --endpoint or --answers dataset: engine (this "
               "project's, for the families it runs), transformers (any family transformers loads), vllm (vLLM's "
               "extract_hidden_states, in the Python of --vllm-python), or auto: the engine where it runs the target, "
               "else vLLM where it is installed, else transformers. Answers generated here are captured by the engine "
               "in the same pass",
    "vllm_python": "the python executable of an environment with vLLM, for --capture vllm (default: this one where it "
                   "imports vllm, else .venv-vllm/bin/python from `make vllm`)",
}


@dataclass
class GenerateConfig:
    prompts: str
    out: str
    target: str = targets.DEFAULT_TARGET
    num_prompts: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    structured_outputs: dict | str | None = None  # vLLM's fields, or their JSON text
    seed: int = 0
    layers: tuple[str, ...] | str = ("last", "eagle3")
    aux_layers: tuple[int, ...] | str | None = None
    turns: str = "first"
    concurrency: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    shard_size: int = 64
    dtype: str = "float32"
    weights: str = "float32"
    device: str = "auto"
    answers: str = "target"
    endpoint: str | None = None
    endpoint_model: str | None = None
    endpoint_concurrency: int = 8
    endpoint_retries: int = 5
    endpoint_timeout: float = 600.0
    endpoint_failure_share: float = 0.05
    endpoint_failures_in_a_row: int = 20
    capture: str = "auto"
    vllm_python: str | None = None

    def __post_init__(self):
        resolve_device(self.device)  # a bad device fails before anything loads
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights={self.weights!r} is invalid: choose one of {', '.join(WEIGHTS)}")
        self.layers = () if _listed(self.layers) == ["none"] else tuple(_listed(self.layers))
        if self.aux_layers is not None:
            self.aux_layers = tuple(int(i) for i in _listed(self.aux_layers))
        if set(self.layers) - set(LAYERS):
            raise ValueError(f"layers={','.join(self.layers)!r} is invalid: choose some of {', '.join(LAYERS)}, "
                             "or none")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(f"aux_layers={self.aux_layers} is invalid: EAGLE-3 fuses exactly three layers (low, middle, high)")
        if self.capture not in CAPTURES:
            raise ValueError(f"capture={self.capture!r} is invalid: choose one of {', '.join(CAPTURES)}")
        if self.capture not in ("auto", "engine") and self.answers == "target" and self.endpoint is None:
            raise ValueError(f"capture={self.capture} reads answers from elsewhere: the target's answers generated "
                             "here are captured by the engine in the same pass. Pass --endpoint URL (a server running "
                             "the target) or --answers dataset, or --capture engine")
        if self.turns not in TURNS:
            raise ValueError(f"turns={self.turns!r} is invalid: choose {' or '.join(TURNS)}")
        if self.answers not in ANSWERS:
            raise ValueError(f"answers={self.answers!r} is invalid: choose {' or '.join(ANSWERS)}")
        if self.endpoint is not None and self.answers == "dataset":
            raise ValueError("answers=dataset takes the prompt source's own answers, so no --endpoint is asked: "
                             "drop one")
        if self.endpoint is not None and self.turns != "first":
            raise ValueError("an --endpoint answers first turns only: pass --turns first (or --answers dataset for "
                             "every turn of the source's own conversations)")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint={self.endpoint!r} is not a URL: give the server's base URL, e.g. "
                             "http://127.0.0.1:8000")
        if not self.endpoint_timeout > 0 or self.endpoint_retries < 0:
            raise ValueError(f"endpoint_timeout={self.endpoint_timeout} must be > 0 and "
                             f"endpoint_retries={self.endpoint_retries} >= 0")
        if not 0 <= self.endpoint_failure_share <= 1:
            raise ValueError(f"endpoint_failure_share={self.endpoint_failure_share} is invalid: give a share in [0, 1]")
        for name in ("max_new_tokens", "concurrency", "max_model_len", "max_num_batched_tokens", "shard_size",
                     "endpoint_concurrency", "endpoint_failures_in_a_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: it must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts} is invalid: it must be >= 1, or null for all")
        if isinstance(self.structured_outputs, str):
            try:
                self.structured_outputs = json.loads(self.structured_outputs)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs is not valid JSON ({error}): {self.structured_outputs!r}") from None
        if self.structured_outputs is not None and (self.answers != "target" or self.endpoint is not None):
            raise ValueError("structured_outputs constrains answers the target generates here: drop --endpoint and "
                             "--answers dataset, or the constraint")
        SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                       structured_outputs=self.structured_outputs)

    @classmethod
    def from_options(cls, options: dict) -> "GenerateConfig":
        """Built-in defaults, overridden by the YAML file in options["config"], overridden by the other options."""
        values = merge_options(options, [f.name for f in fields(cls)])
        for name in ("prompts", "out"):
            if values.get(name) is None:
                raise ValueError(f"no {name} given: pass --{name} or set `{name}:` in the --config file")
        return cls(**values)

    def engine(self, folder: Path, aux_layers: tuple[int, ...], capture_hidden: bool, max_model_len: int) -> Engine:
        """The engine these settings describe, for the target in `folder`."""
        return Engine(EngineConfig(self.target, dtype=self.dtype, weights=self.weights, max_num_seqs=self.concurrency,
                      max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_model_len,
                      kv_cache_memory_gib=kv_cache_gib(folder, self), capture_hidden=capture_hidden,
                      aux_layers=aux_layers, device=self.device))


def _listed(value) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers, as vLLM and SpecForge choose them."""
    return 2, num_layers // 2, num_layers - 3


def kv_cache_gib(folder: Path, config: GenerateConfig) -> float:
    """The engine's K/V pool: room for every running conversation at full length, at most 1 GiB."""
    model = ModelConfig.from_folder(folder)
    bytes_per_token = KVCache.bytes_per_block(model.num_layers, 1, model.layer.num_kv_heads, model.layer.head_dim,
                                              DTYPES[config.dtype])
    return min(1.0, config.concurrency * config.max_model_len * bytes_per_token / 2**30)


@dataclass
class Conversation:
    id: str
    category: str
    turns: list[list[dict]]  # per answer: the messages that lead to it
    history: list[dict] = field(default_factory=list)  # messages so far, the target's answers as text
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on the target's own answer tokens

    @property
    def num_answers(self) -> int:
        return sum(message["role"] == "assistant" for message in self.history)


def generate(config: GenerateConfig, progress: bool = True) -> dict:
    """Answers the prompts of `config` into the store at config.out, resuming it; returns the summary."""
    folder = targets.resolve(config.target)
    fingerprint = targets.fingerprint(folder)
    num_layers = fingerprint["num_layers"]
    aux_layers = (config.aux_layers or default_aux_layers(num_layers)) if "eagle3" in config.layers else ()
    if any(not 0 <= i < num_layers for i in aux_layers):
        raise ValueError(f"aux layers {aux_layers} do not all lie in [0, {num_layers}) for this {num_layers}-layer "
                         "target: pass --aux-layers LOW,MID,HIGH")
    rows = load_rows(config)
    if config.endpoint is None:
        return write_store(config, folder, fingerprint, aux_layers, rows, None, progress)
    endpoint = Endpoint(config.endpoint, config.endpoint_model, concurrency=config.endpoint_concurrency,
                        timeout_s=config.endpoint_timeout, num_retries=config.endpoint_retries)
    try:
        return write_store(config, folder, fingerprint, aux_layers, rows, endpoint, progress)
    finally:
        endpoint.close()


def write_store(config: GenerateConfig, folder: Path, fingerprint: dict, aux_layers: tuple[int, ...], rows,
                endpoint: Endpoint | None, progress: bool) -> dict:
    prompt_file = Path(config.prompts)
    answers = {"source": config.answers}
    if endpoint is not None:
        answers = {"source": "endpoint", "model": endpoint.model, "endpoint": endpoint.url}
    writer = StoreWriter(config.out, {
        # bfloat16 weights answer differently; stores made with float32 ones (no key) resume as before
        "target": {"name": config.target, "fingerprint": fingerprint, "dtype": config.dtype,
                   **({"weights": config.weights} if config.weights != "float32" else {})},
        "layers": list(config.layers),
        "aux_layers": list(aux_layers),
        "hidden_size": fingerprint["hidden_size"],
        "hidden_dtype": str(HIDDEN_DTYPE).removeprefix("torch."),
        "sampling": {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
                     "top_p": config.top_p, "seed": config.seed,
                     **({"structured_outputs": config.structured_outputs} if config.structured_outputs else {})},
        "prompts": {"source": str(prompt_file.resolve()) if prompt_file.is_file() else config.prompts,
                    "turns": config.turns, "max_model_len": config.max_model_len},
        "num_prompts": config.num_prompts,
        "answers": answers,
    }, config.shard_size)
    num_examples_before = writer.counts["num_examples"]
    if config.answers == "target" and endpoint is None:
        generation = Generation(config, folder, aux_layers, writer, rows)
    else:
        generation = TeacherForcedGeneration(config, folder, aux_layers, writer, rows, endpoint)
    is_complete = False
    try:
        try:
            generation.run(progress)
            is_complete = True
        finally:
            writer.close(is_complete)  # commits the finished conversations even when generation stops early
    except EndpointError as error:
        raise EndpointError(f"{error}\n{writer.counts['num_examples']} examples are stored in {writer.path} and kept: "
                            "rerun the same command to answer the rest", error.status, error.reply) from None
    counts = writer.counts
    if not counts["num_examples"] and generation.num_skipped:
        raise ValueError(f"every prompt ({generation.num_skipped}) is longer than max_model_len={config.max_model_len} "
                         f"tokens, so {writer.path} holds no example: rerun with a larger --max-model-len (the empty "
                         "store takes the new settings)")
    keys = tensor_keys(config.layers, aux_layers)
    summary = {
        "out": str(writer.path),
        **counts,
        "num_bytes": writer.num_bytes(),
        "bytes_per_token_per_layer": writer.num_bytes(("hidden-",)) / max(1, counts["num_tokens"] * len(keys)),
        "num_new_examples": counts["num_examples"] - num_examples_before,
        "num_skipped": generation.num_skipped,
        "num_new_answer_tokens": generation.num_answer_tokens,
        "elapsed_s": generation.elapsed_s,
        "answer_tokens_per_s": generation.num_answer_tokens / generation.elapsed_s if generation.elapsed_s else 0.0,
    }
    if isinstance(generation, TeacherForcedGeneration):
        summary["answer_ids"] = generation.answer_ids
        summary["num_dropped"] = generation.outcomes["dropped"]
        summary["num_unanswered"] = generation.outcomes["unanswered"]
        summary["failed"] = dict(generation.failures)
    if endpoint is not None:
        summary["endpoint_retries"] = endpoint.num_retried
    return summary


def load_rows(config: GenerateConfig):
    rows = load_prompts(config.prompts, config.num_prompts)
    ids = rows["id"]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"prompt source {config.prompts} has id {duplicate!r} more than once: ids name a store's "
                         "examples (a resumed run skips those done), so give every conversation its own id")
    return rows


class Generation:
    """One run of the engine over the conversations a store does not hold yet."""

    def __init__(self, config: GenerateConfig, folder: Path, aux_layers: tuple[int, ...], writer: StoreWriter, rows):
        self.config, self.folder, self.aux_layers, self.writer, self.rows = config, folder, aux_layers, writer, rows
        self.keys = tensor_keys(config.layers, aux_layers)
        self.todo = [row for row in self.rows if row["id"] not in writer.done_ids]
        self.active: dict[str, Conversation] = {}  # request id -> its conversation
        self.num_skipped = self.num_answer_tokens = 0
        self.elapsed_s = 0.0

    def run(self, progress: bool) -> None:
        if not self.todo:
            return
        config = self.config
        self.engine = config.engine(self.folder, self.aux_layers, capture_hidden=bool(self.keys),
                                    max_model_len=config.max_model_len)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"target {config.target} has no tokenizer with a chat template: generate renders chat prompts")
        self.queue = iter(self.todo)
        self.bar = tqdm(total=len(self.rows), initial=len(self.rows) - len(self.todo), desc="prompts", unit="prompt",
                        disable=not progress)
        start = time.perf_counter()
        for _ in range(config.concurrency):
            self.start_next()
        while self.engine.has_unfinished():
            for output in self.engine.step():
                self.answered(self.active.pop(output.request_id), output)
                self.elapsed_s = time.perf_counter() - start
                self.bar.set_postfix_str(f"{self.num_answer_tokens / self.elapsed_s:.1f} answer tok/s", refresh=False)
        self.bar.close()

    def start_next(self) -> None:
        """Submits the first turn of the next conversation that fits in max_model_len."""
        for row in self.queue:
            conversation = Conversation(row["id"], row["category"], user_turns(row["messages"], self.config.turns))
            prompt_ids = self.engine.encode(conversation.turns[0])
            if len(prompt_ids) < self.engine.max_model_len:
                conversation.input_ids, conversation.loss_mask = prompt_ids, [0] * len(prompt_ids)
                self.submit(conversation, prompt_ids)
                return
            self.num_skipped += 1
            self.bar.update(1)

    def submit(self, conversation: Conversation, prompt_ids: list[int]) -> None:
        config, turn = self.config, conversation.num_answers
        params = SamplingParams(max_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                                seed=request_seed(config.seed, conversation.id, turn),
                                structured_outputs=config.structured_outputs)
        self.active[self.engine.add_request(prompt_ids, params, request_id=f"{conversation.id}/{turn}")] = conversation

    def answered(self, conversation: Conversation, output) -> None:
        """Submits the conversation's next turn, or stores the conversation when it is done."""
        answer = output.token_ids
        self.num_answer_tokens += len(answer)
        turn = conversation.num_answers
        conversation.input_ids = conversation.input_ids + answer
        conversation.loss_mask = conversation.loss_mask + [1] * len(answer)
        conversation.history += conversation.turns[turn] + [
            {"role": "assistant", "content": self.tokenizer.decode(answer, skip_special_tokens=True)}]
        if turn + 1 < len(conversation.turns):
            stop_token = answer[-1] if output.finish_reason == "stop" else None
            template_ids = template_ids_after_answer(self.tokenizer, conversation.history[:-1],
                                                     conversation.turns[turn + 1], stop_token)
            prompt_ids = conversation.input_ids + template_ids
            if len(prompt_ids) < self.engine.max_model_len:
                conversation.input_ids = prompt_ids
                conversation.loss_mask = conversation.loss_mask + [0] * len(template_ids)
                self.submit(conversation, prompt_ids)
                return
        # The last request covers the whole conversation, so its hidden states are those of every token.
        captured = {"last": output.hidden, **{f"aux.{i}": h for i, h in output.aux.items()}}  # [T, hidden] each
        self.writer.add({"id": conversation.id, "category": conversation.category, "input_ids": conversation.input_ids,
                         "loss_mask": conversation.loss_mask,
                         "hidden": {key: captured[key].to(HIDDEN_DTYPE) for key in self.keys}})
        self.bar.update(1)
        self.start_next()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    types = {"num_prompts": int, "max_new_tokens": int, "temperature": float, "top_p": float, "seed": int,
             "concurrency": int, "max_model_len": int, "max_num_batched_tokens": int, "shard_size": int,
             "endpoint_concurrency": int, "endpoint_retries": int, "endpoint_timeout": float,
             "endpoint_failure_share": float, "endpoint_failures_in_a_row": int}
    add_options(parser, GenerateConfig, HELP, types,
                {"turns": {"choices": TURNS}, "dtype": {"choices": DTYPES}, "weights": {"choices": WEIGHTS},
                 "answers": {"choices": ANSWERS}, "endpoint": {"metavar": "URL"}, "endpoint_model": {"metavar": "NAME"},
                 "structured_outputs": {"metavar": "JSON"}, "capture": {"choices": CAPTURES},
                 "vllm_python": {"metavar": "PATH"}})


def run(args: argparse.Namespace) -> int:
    try:
        summary = generate(GenerateConfig.from_options(vars(args)))
    except EndpointError as error:
        print(f"draftheads generate: error: {error}", file=sys.stderr)
        return 2
    print(f"store {summary['out']}: {summary['num_examples']} examples, {summary['num_tokens']} tokens, "
          f"{summary['num_answer_tokens']} answer tokens, {summary['num_bytes'] / 2**20:.1f} MiB on disk, "
          f"{summary['bytes_per_token_per_layer']:.0f} bytes per token per layer")
    print(f"this run: {summary['num_new_examples']} examples, {summary['num_new_answer_tokens']} answer tokens in {summary['elapsed_s']:.1f} s "
          f"({summary['answer_tokens_per_s']:.1f} tok/s); {summary['num_skipped']} prompts longer than max_model_len "
          "(or the endpoint's context) skipped")
    if "answer_ids" in summary:
        ids = summary["answer_ids"]
        print(f"answers in the store: {ids['num_token_ids']} as the endpoint's token ids, {ids['num_from_text']} as text "
              f"tokenized here; {len(ids['dropped'])} dropped (their text does not tokenize back to itself); this run "
              f"{summary['num_unanswered']} conversations with no answer in the dataset")
    if summary.get("failed"):
        print(f"{len(summary['failed'])} conversations failed at the endpoint and are not stored (a rerun asks for "
              f"them again); the first, {next(iter(summary['failed']))}: {next(iter(summary['failed'].values()))}")
    if "endpoint_retries" in summary:
        print(f"endpoint: {summary['endpoint_retries']} requests retried")
