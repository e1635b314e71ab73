"""`draftheads generate` with answers from elsewhere: an endpoint's store equals the in-process store for the same
answers, a dataset-answers store holds what a transformers forward over its tokens gives, and a failing endpoint is
retried, then named in a clear error, with every answer stored before it kept for a rerun to resume from.

`draftheads serve` runs in this process (uvicorn in a thread) on the tiny target of test_server.py, whose greedy
answers differ from prompt to prompt; a stdlib fake server stands in for endpoints that answer in text only, or fail.
"""
from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving import targets
from serving.config import EngineConfig
from serving.engine import Engine
from serving.server.app import build_app
from serving.server.serve import listen
from training.cli import main as cli
from training.data.chat import prompt_ids
from training.data.endpoint import EndpointError
from training.data.generate import GenerateConfig, generate
from training.data.store import Store

from local_server import running

PROMPTS = [{"id": f"q{i}", "prompt": f"Question {i}: tell me about topic number {7 * i}."} for i in range(5)]
PROMPTS.append({"id": "system", "messages": [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": "What is seven times six?"}]})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return targets.build_tiny_model(tmp_path_factory.mktemp("tiny_chat"), "llama", seed=3,
                                    tokenizer_from=targets.resolve(targets.DEFAULT_TARGET), tie_word_embeddings=True,
                                    max_position_embeddings=4096, initializer_range=0.1)


def write_prompts(path: Path, conversations) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


@contextlib.contextmanager
def serving(target: Path):
    """`draftheads serve`'s app over the target, greedy float32, on a free port; yields its base URL."""
    with running(build_app(Engine(EngineConfig(str(target), max_model_len=256, num_blocks=64)), "tiny")) as url:
        yield url


def test_endpoint_store_equals_the_in_process_store(target, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    common = dict(prompts=str(prompts), target=str(target), max_new_tokens=12, concurrency=3, max_num_batched_tokens=16,
                  max_model_len=256)
    generate(GenerateConfig(out=str(tmp_path / "engine"), **common), progress=False)
    with serving(target) as url:
        summary = generate(GenerateConfig(out=str(tmp_path / "endpoint"), endpoint=url + "/v1", endpoint_concurrency=4,
                                          **common), progress=False)
    assert summary["answer_ids"] == {"num_token_ids": len(PROMPTS), "num_from_text": 0, "dropped": []}
    in_process, from_endpoint = Store(tmp_path / "engine"), Store(tmp_path / "endpoint")
    assert from_endpoint.meta["answers"] == {"source": "endpoint", "model": "tiny", "endpoint": url}
    assert in_process.meta["answers"] == {"source": "target"}
    assert sorted(from_endpoint.table["id"]) == sorted(in_process.table["id"]) == sorted(p["id"] for p in PROMPTS)
    expected = {item["id"]: item for item in in_process}
    answers = set()
    for item in from_endpoint:
        other = expected[item["id"]]
        assert item["input_ids"].tolist() == other["input_ids"].tolist()
        assert item["loss_mask"].tolist() == other["loss_mask"].tolist()
        assert len(item["input_ids"]) > 2 * 16, "the teacher-forced pass was not prefilled in chunks"
        for key in ("last", "eagle3"):
            # bfloat16's tolerance; equal on the CPU kernels, which compute a row the same whatever the batch
            torch.testing.assert_close(item["hidden"][key], other["hidden"][key])
        answers.add(tuple(item["input_ids"][item["loss_mask"].bool()].tolist()))
    assert len(answers) == len(PROMPTS), "the target gave the same answer twice: a crossed answer would go unseen"


CONVERSATIONS = [
    {"id": "two-turns", "messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, yellow and blue."},
        {"role": "user", "content": "Which of them is the warmest?"},
        {"role": "assistant", "content": "Red is usually seen as the warmest of them."},
        {"role": "user", "content": "A last question the dataset never answers."}]},
    {"id": "long-answer", "messages": [
        {"role": "user", "content": "Count to forty."},
        {"role": "assistant", "content": " ".join(str(i) for i in range(1, 41))}]},
    {"id": "unanswered", "prompt": "Nobody answers this."},
    {"id": "special", "messages": [
        {"role": "user", "content": "Say the stop token."},
        {"role": "assistant", "content": "Here it is: <|im_end|> and more."}]},
]


def test_dataset_answers_store_equals_a_transformers_forward_over_the_rendered_conversation(target, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVERSATIONS)
    summary = generate(GenerateConfig(prompts=str(prompts), out=str(tmp_path / "store"), target=str(target),
                                      answers="dataset", turns="all", max_new_tokens=24, max_num_batched_tokens=16),
                       progress=False)
    assert (summary["num_examples"], summary["num_unanswered"], summary["answer_ids"]["dropped"]) == (2, 1, ["special"])
    store = Store(tmp_path / "store")
    assert store.meta["answers"] == {"source": "dataset"}
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_id = {c["id"]: c["messages"] for c in CONVERSATIONS if "messages" in c}
    for item in store:
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        with torch.no_grad():
            states = model(item["input_ids"][None], output_hidden_states=True).hidden_states  # [1, T, hidden] each
        torch.testing.assert_close(item["hidden"]["last"], states[-1][0].to(torch.bfloat16))
        eagle3 = torch.cat([states[i][0] for i in (2, 2, 1)], dim=-1)  # aux layers (2, L//2, L-3) for L=4
        torch.testing.assert_close(item["hidden"]["eagle3"], eagle3.to(torch.bfloat16))
        messages = by_id[item["id"]]
        if item["id"] == "two-turns":  # both answers whole, each closed by the stop token; the unanswered turn left out
            whole = tokenizer.apply_chat_template(messages[:5], tokenize=False)
            assert ids == tokenizer.encode(whole, add_special_tokens=False)[:-1]  # up to the closing "\n"
            answers = [tokenizer.encode(m["content"], add_special_tokens=False) + [eos]
                       for m in messages if m["role"] == "assistant"]
            assert [t for t, bit in zip(ids, mask) if bit] == answers[0] + answers[1]
        else:  # cut at max_new_tokens, with no stop token
            prompt = prompt_ids(tokenizer, messages[:1])
            answer = tokenizer.encode(messages[1]["content"], add_special_tokens=False)
            assert ids == prompt + answer[:24] and mask == [0] * len(prompt) + [1] * 24


class FakeEndpoint:
    """A chat completions server that answers in text only (refusing vLLM's return_token_ids by name, as strict
    servers do), each prompt with its `answers` entry; once `num_answers_left` reaches 0 it answers 500. /v1/models
    lists the model "tiny", with `max_model_len` when set. Faults: a question in `refused` gets a 400 with that
    message; one in `drop_once` gets its connection closed with no reply the first time it is asked."""

    def __init__(self, answers: dict[str, str]):
        self.answers, self.num_answers_left, self.calls = answers, None, []
        self.max_model_len, self.refused, self.drop_once = None, {}, set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                entry = {"id": "tiny", "object": "model"}
                if fake.max_model_len is not None:
                    entry["max_model_len"] = fake.max_model_len
                self.reply(200, {"object": "list", "data": [entry]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if "return_token_ids" in body:
                    return self.reply(400, {"error": {"message": "unknown field 'return_token_ids'"}})
                question = body["messages"][-1]["content"]
                fake.calls.append(question)
                if question in fake.drop_once:
                    fake.drop_once.discard(question)
                    self.close_connection = True
                    return
                if question in fake.refused:
                    return self.reply(400, {"error": {"message": fake.refused[question]}})
                if fake.num_answers_left == 0:
                    return self.reply(500, {"error": {"message": "the engine crashed"}})
                if fake.num_answers_left is not None:
                    fake.num_answers_left -= 1
                self.reply(200, {"choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": fake.answers[question]}}]})

            def reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_failing_endpoint_is_retried_then_named_and_what_was_stored_is_kept(target, tmp_path):
    questions = [f"Question {i}?" for i in range(6)]
    answers = {q: f"Answer number {i}, in text." for i, q in enumerate(questions)}
    answers[questions[1]] = "This text holds <|im_end|> as plain text."  # tokenizes to the special token: dropped
    prompts = write_prompts(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": q} for i, q in enumerate(questions)])
    fake = FakeEndpoint(answers)
    fake.num_answers_left = 3
    config = GenerateConfig(prompts=str(prompts), out=str(tmp_path / "store"), target=str(target), layers="none",
                            endpoint=fake.url, endpoint_model="tiny", endpoint_concurrency=1, endpoint_retries=2,
                            max_new_tokens=32)
    try:
        with pytest.raises(EndpointError) as failure:
            generate(config, progress=False)
        message = str(failure.value)
        assert "1 of the 6 conversations asked for failed, more than the 5% allowed" in message
        assert f"{fake.url}/v1/chat/completions failed 3 times" in message and "HTTP 500: the engine crashed" in message
        assert f"2 examples are stored in {tmp_path / 'store'} and kept" in message
        assert fake.calls == questions[:3] + [questions[3]] * 3  # one request at a time, the failing one tried 3 times
        store = Store(tmp_path / "store")
        assert sorted(store.table["id"]) == ["p0", "p2"] and store.meta["complete"] is False
        assert store.meta["answer_ids"] == {"num_token_ids": 0, "num_from_text": 2, "dropped": ["p1"]}

        fake.num_answers_left, fake.calls = None, []
        summary = generate(config, progress=False)  # the endpoint is back: the rerun asks only for what is missing
        assert fake.calls == questions[3:]
    finally:
        fake.close()
    store = Store(tmp_path / "store")
    assert summary["num_new_examples"] == 3 and store.meta["complete"] is True and store.layers == ()
    assert store.meta["answer_ids"] == {"num_token_ids": 0, "num_from_text": 5, "dropped": ["p1"]}
    tokenizer = AutoTokenizer.from_pretrained(target)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for item in store:
        i = int(item["id"][1:])
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": questions[i]}])
        answer = tokenizer.encode(answers[questions[i]], add_special_tokens=False) + [eos]  # it stopped: eos closes it
        assert item["input_ids"].tolist() == prompt + answer and item["hidden"] == {}
        assert item["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(answer)


def test_a_refused_connection_is_retried_then_named_on_the_command_line(target, tmp_path, capsys):
    listener = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()  # nothing listens there now
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:2])
    code = cli(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "store"), "--target", str(target),
                "--endpoint", url, "--endpoint-retries", "1"])
    error = capsys.readouterr().err
    assert code == 2
    assert f"draftheads generate: error: {url}/v1/models failed 2 times" in error and "ConnectError" in error


def test_endpoint_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="answers first turns only"):
        GenerateConfig(prompts="mt-bench", out=str(tmp_path), endpoint="http://127.0.0.1:1", turns="all")
    with pytest.raises(ValueError, match="no --endpoint is asked"):
        GenerateConfig(prompts="mt-bench", out=str(tmp_path), endpoint="http://127.0.0.1:1", answers="dataset")
    with pytest.raises(ValueError, match="is not a URL"):
        GenerateConfig(prompts="mt-bench", out=str(tmp_path), endpoint="127.0.0.1:8000")
    assert GenerateConfig(prompts="mt-bench", out=str(tmp_path), layers="none").layers == ()


def test_a_run_skips_what_the_endpoint_cannot_take_and_its_store_equals_a_clean_runs(target, tmp_path):
    """One prompt longer than the endpoint's context, one the endpoint refuses, one whose connection drops once: the
    run completes, counts each, and stores what a clean run over the other prompts stores, hidden states included."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    long = "Please read all of this: " + "words upon words " * 40
    questions = [f"Question {i}: say something about {i}." for i in range(8)] + [long]
    answers = {q: f"Answer {i}, a short one." for i, q in enumerate(questions)}
    rows = [{"id": f"p{i}", "prompt": q} for i, q in enumerate(questions)]
    limit = 64
    assert len(prompt_ids(tokenizer, [{"role": "user", "content": long}])) > limit > max(
        len(prompt_ids(tokenizer, [{"role": "user", "content": q}])) + 16 for q in questions[:-1])
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    common = dict(target=str(target), layers="last", endpoint_model="tiny", max_new_tokens=16, endpoint_retries=2,
                  endpoint_concurrency=2, endpoint_failure_share=0.2)
    fake = FakeEndpoint(answers)
    try:
        fake.max_model_len = limit  # listed at /v1/models: the long prompt is never sent
        fake.refused = {questions[2]: "this request breaks a rule of the server"}
        fake.drop_once = {questions[5]}
        summary = generate(GenerateConfig(prompts=str(prompts), out=str(tmp_path / "faulty"), endpoint=fake.url,
                                          **common), progress=False)
        assert long not in fake.calls and fake.calls.count(questions[5]) == 2
        assert summary["num_skipped"] == 1 and summary["endpoint_retries"] == 1
        assert list(summary["failed"]) == ["p2"] and "this request breaks a rule" in summary["failed"]["p2"]
        assert summary["num_new_examples"] == 7

        fake.max_model_len, fake.refused, fake.calls = None, {}, []  # unlisted: the endpoint refuses it by its length
        fake.refused = {long: "This model's maximum context length is 64 tokens. However, your prompt contains 200 "
                              "input tokens, which exceeds this limit even without any output tokens."}
        clean_rows = [row for row in rows if row["id"] not in ("p2", "p8")]
        clean = generate(GenerateConfig(prompts=str(write_prompts(tmp_path / "clean.jsonl", clean_rows)),
                                        out=str(tmp_path / "clean"), endpoint=fake.url, **common), progress=False)
        assert clean["num_new_examples"] == 7 and not clean["failed"] and clean["endpoint_retries"] == 0

        rerun = generate(GenerateConfig(prompts=str(prompts), out=str(tmp_path / "faulty"), endpoint=fake.url,
                                        **common), progress=False)
        assert rerun["num_new_examples"] == 1 and rerun["num_skipped"] == 1 and not rerun["failed"]
    finally:
        fake.close()
    faulty, expected = Store(tmp_path / "faulty"), {item["id"]: item for item in Store(tmp_path / "clean")}
    assert sorted(faulty.table["id"]) == sorted([*expected, "p2"])
    for item in faulty:
        if item["id"] == "p2":
            continue
        other = expected[item["id"]]
        assert item["input_ids"].tolist() == other["input_ids"].tolist()
        assert item["loss_mask"].tolist() == other["loss_mask"].tolist()
        assert torch.equal(item["hidden"]["last"], other["hidden"]["last"])


def test_failures_in_a_row_stop_the_run_with_what_was_stored_kept(target, tmp_path):
    questions = [f"Question {i}?" for i in range(5)]
    prompts = write_prompts(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": q} for i, q in enumerate(questions)])
    fake = FakeEndpoint({q: "An answer." for q in questions})
    fake.refused = {q: "refused" for q in questions[1:]}
    try:
        with pytest.raises(EndpointError, match=r"3 requests failed in a row \(the limit is 3\)"):
            generate(GenerateConfig(prompts=str(prompts), out=str(tmp_path / "store"), target=str(target),
                                    layers="none", endpoint=fake.url, endpoint_concurrency=1, endpoint_failure_share=1,
                                    endpoint_failures_in_a_row=3), progress=False)
    finally:
        fake.close()
    assert fake.calls == questions[:4]
    assert Store(tmp_path / "store").table["id"] == ["p0"]
