"""`draftheads serve` under load and faults, every byte on 127.0.0.1, each server started and stopped here.

The target is the debug target's recipe (a tiny random Llama with the default target's tokenizer and chat template)
with a wider weight init: the debug target answers every prompt with the same repeated word, so crossed streams
would go unseen, while this one answers each prompt differently and drafts are sometimes accepted. The drafter is
an untrained EAGLE-1 head drafting after prompt lookup, so aborts also reset a head's per-request state. One
server runs in this process (uvicorn in a thread) for the load and error tests; the SIGTERM test runs the real
`draftheads serve` command in a subprocess.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import heads
from serving import targets
from serving.bench.bench_serve import BenchServeConfig, arrival_times, make_report, measure, serve_and_bench, write_report
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.spec_decode.metrics import AcceptanceStats
from serving.server.app import build_app
from serving.server.detokenizer import Detokenizer

from local_server import running

MODEL = "tiny"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 256  # 4,096 tokens: room for 16 requests at full length
PROMPTS = [[{"role": "user", "content": f"Question {i}: tell me about topic number {7 * i}."}] for i in range(16)]
MAX_TOKENS = [24 + 8 * (i % 4) for i in range(16)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return targets.build_tiny_model(tmp_path_factory.mktemp("tiny_chat"), "llama", seed=3,
                                    tokenizer_from=targets.resolve(targets.DEFAULT_TARGET), tie_word_embeddings=True,
                                    max_position_embeddings=4096, initializer_range=0.1)


@pytest.fixture(scope="module")
def speculative_config(target, tmp_path_factory):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = heads.Eagle.from_target(heads.load_target_parts(target, fingerprint=targets.fingerprint(target)))
    folder = heads.save(head, tmp_path_factory.mktemp("head") / "eagle")
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "prompt_lookup_first": True}


@pytest.fixture(scope="module")
def offline(target):
    """Greedy outputs of the engine on its own, without speculation (float32: speculation does not change them)."""
    engine = Engine(EngineConfig(str(target), max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS))
    cache = {}

    def run(prompt, max_tokens, **params):
        key = (repr(prompt), max_tokens, repr(sorted(params.items())))
        if key not in cache:
            [cache[key]] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, **params))
        return cache[key]
    return run


@pytest.fixture(scope="module")
def server(target, speculative_config):
    engine = Engine(EngineConfig(str(target), max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS, max_num_seqs=16,
                    speculative_config=speculative_config))
    app = build_app(engine, MODEL)
    with running(app) as url:
        yield url, app.state.engine_loop


def engine_state(loop):
    """(free blocks, requests in the engine, any block still referenced), read in the engine thread."""
    return loop.call(lambda engine: (engine.block_manager.num_free_blocks, len(engine.requests),
                                     any(engine.block_manager.ref_counts))).result(10)


def counters(url) -> dict:
    """Every counter sample of /metrics: (name, position label) -> value."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = (sample.name, sample.labels.get("position") or sample.labels.get("finished_reason"))
                values[key] = sample.value
    return values


def difference(after: dict, before: dict, name: str, label=None) -> float:
    return after.get((name, label), 0) - before.get((name, label), 0)


async def stream_chat(client, i, close_after=None):
    """One streaming chat request; the text, finish reason and usage, or None for a client that leaves after
    `close_after` content chunks."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=PROMPTS[i], max_tokens=MAX_TOKENS[i] if close_after is None else 200, temperature=0,
        stream=True, stream_options={"include_usage": True})
    text, finish_reason, usage, num_chunks = "", None, None, 0
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            num_chunks += bool(choice.delta.content)
        if close_after is not None and num_chunks >= close_after:
            await stream.close()
            return None
    return text, finish_reason, usage


async def many_clients(url, leavers=()):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
        return await asyncio.gather(*(stream_chat(client, i, 2 if i in leavers else None) for i in range(16)))


def assert_same_as_offline(offline, results, leavers=()):
    for i, result in enumerate(results):
        if i in leavers:
            assert result is None
            continue
        text, finish_reason, usage = result
        expected = offline(PROMPTS[i], MAX_TOKENS[i], temperature=0)
        assert text == expected.text, f"request {i}"
        assert (finish_reason, usage.completion_tokens) == (expected.finish_reason, len(expected.token_ids))
        assert usage.prompt_tokens == len(expected.prompt_token_ids)


def test_concurrent_streams_equal_offline_and_sum_to_metrics(server, offline):
    url, _ = server
    before = counters(url)
    results = asyncio.run(many_clients(url))
    after = counters(url)
    assert_same_as_offline(offline, results)

    spec = [usage.model_extra["speculative"] for _, _, usage in results]
    total = lambda key: sum(s[key] for s in spec)
    assert total("spec_decode_num_drafts") > 0 and total("spec_decode_num_accepted_tokens") > 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert difference(after, before, f"vllm:spec_decode_{name}_total") == total(f"spec_decode_{name}"), name
    assert difference(after, before, "draftheads:spec_decode_num_verify_steps_total") == total("num_verify_steps")
    assert difference(after, before, "draftheads:spec_decode_num_emitted_tokens_total") == total("num_emitted_tokens")
    for position in range(3):  # vLLM's labels: the draft position from 0
        assert (difference(after, before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", str(position))
                == sum(s["spec_decode_num_accepted_tokens_per_pos"][position] for s in spec))
    assert difference(after, before, "vllm:generation_tokens_total") == sum(u.completion_tokens for _, _, u in results)
    assert difference(after, before, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for _, _, u in results)
    finished = sum(difference(after, before, "vllm:request_success_total", reason) for reason in ("stop", "length"))
    assert finished == 16


def test_clients_that_leave_free_their_blocks(server, offline):
    url, loop = server
    num_free_before, num_requests, _ = engine_state(loop)
    assert num_requests == 0
    before = counters(url)
    leavers = {0, 5, 10, 15}
    results = asyncio.run(many_clients(url, leavers))
    assert_same_as_offline(offline, results, leavers)
    deadline = time.monotonic() + 10
    while engine_state(loop) != (num_free_before, 0, False):
        assert time.monotonic() < deadline, f"blocks not back: {engine_state(loop)} != ({num_free_before}, 0, False)"
        time.sleep(0.05)
    after = counters(url)
    finished = sum(difference(after, before, "vllm:request_success_total", reason) for reason in ("stop", "length"))
    assert finished == 12, "the clients that left were not aborted"


def chat(**fields):
    return {"model": MODEL, "messages": PROMPTS[0], "max_tokens": 8, **fields}


BAD_REQUESTS = [  # (path, body (raw bytes are sent as they are), status, words in the message, param)
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "not valid JSON", None),
    ("/v1/chat/completions", b'[1, 2]', 400, "must be a JSON object", None),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 8}, 400, "messages is required", "messages"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages is empty", "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role", "messages"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 8}, 400, "prompt is required", "prompt"),
    ("/v1/chat/completions", chat(model="gpt-4o"), 404, "'gpt-4o' does not exist", "model"),
    ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens=0 is invalid", "max_tokens"),
    ("/v1/chat/completions", chat(temperature=-0.5), 400, "temperature=-0.5 is invalid", "temperature"),
    ("/v1/chat/completions", chat(top_p=0), 400, "top_p=0.0 is invalid", "top_p"),
    ("/v1/chat/completions", chat(top_p=1.5), 400, "top_p=1.5 is invalid", "top_p"),
    ("/v1/chat/completions", chat(best_of=2), 400, "unknown field 'best_of'", "best_of"),
    ("/v1/chat/completions", chat(n=0), 400, "n=0 is invalid", "n"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs=21 is invalid", "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs=21 is invalid", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": [100] * 300}, 400,
     "the prompt has 300 tokens but max_model_len is 256", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [100] * 100, "max_tokens": 200}, 400,
     "max_tokens=200 after a prompt of 100 tokens needs 300 tokens of context", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10 ** 6], "max_tokens": 4}, 400,
     "prompt token ids must lie in [0, 49152)", None),  # refused by the engine itself, in its thread
    ("/v1/embeddings", {"model": MODEL}, 404, "Not Found", None),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, offline):
    url, loop = server
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body, status, words, param in BAD_REQUESTS:
            response = (http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body))
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (status, param), (body, error)
            assert words in error["message"], (body, error)
            assert set(error) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model=MODEL, messages=PROMPTS[0], top_logprobs=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="davinci", prompt="hi")
    answer = client.chat.completions.create(model=MODEL, messages=PROMPTS[3], max_tokens=MAX_TOKENS[3], temperature=0)
    assert answer.choices[0].message.content == offline(PROMPTS[3], MAX_TOKENS[3], temperature=0).text
    assert engine_state(loop)[1:] == (0, False)


def test_stop_strings_logprobs_and_token_prompts_match_the_engine(server, offline):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    full = offline(PROMPTS[6], 48, temperature=0)
    stop = full.text[len(full.text) // 2:][:3]
    expected = offline(PROMPTS[6], 48, temperature=0, stop=[stop])
    assert expected.finish_reason == "stop" and len(expected.text) < len(full.text)
    whole = client.chat.completions.create(model=MODEL, messages=PROMPTS[6], max_tokens=48, temperature=0, stop=stop)
    streamed = client.chat.completions.create(model=MODEL, messages=PROMPTS[6], max_tokens=48, temperature=0,
                                              stop=stop, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert whole.choices[0].message.content == "".join(deltas) == expected.text
    assert whole.choices[0].finish_reason == "stop"

    with_logprobs = client.chat.completions.create(model=MODEL, messages=PROMPTS[7], max_tokens=16, temperature=0,
                                                   logprobs=True)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == with_logprobs.usage.completion_tokens == 16 and all(t.logprob <= 0 for t in content)
    assert with_logprobs.usage.model_extra["speculative"]["spec_decode_num_drafts"] > 0  # speculated

    ids = [17, 923, 4411, 88, 2045, 301]
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0).choices[0].text
    assert text == offline(ids, 20, temperature=0).text
    seeded = [client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0.8, seed=5)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_top_logprobs_speculate_and_are_plain_decodings_streamed_and_whole(server, offline):
    """The logprobs are the target's at the verified rows: those plain decoding gives, alternatives included."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    expected = offline(PROMPTS[9], 20, temperature=0, logprobs=True, top_logprobs=3)
    tokenizer = client_tokenizer(server)
    whole = client.chat.completions.create(model=MODEL, messages=PROMPTS[9], max_tokens=20, temperature=0,
                                           logprobs=True, top_logprobs=3)
    streamed = client.chat.completions.create(model=MODEL, messages=PROMPTS[9], max_tokens=20, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    streamed_content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    for content in (whole.choices[0].logprobs.content, streamed_content):
        assert [t.token for t in content] == [tokenizer.decode([t]) for t in expected.token_ids]
        torch.testing.assert_close(torch.tensor([t.logprob for t in content]), torch.tensor(expected.logprobs),
                                   atol=1e-4, rtol=1e-4)
        assert [[a.token for a in t.top_logprobs] for t in content] == [
            [tokenizer.decode([a]) for a, _ in row] for row in expected.top_logprobs]
        torch.testing.assert_close(torch.tensor([[a.logprob for a in t.top_logprobs] for t in content]),
                                   torch.tensor([[lp for _, lp in row] for row in expected.top_logprobs]),
                                   atol=1e-4, rtol=1e-4)
    for usage in (whole.usage, chunks[-1].usage):
        assert usage.model_extra["speculative"]["spec_decode_num_drafts"] > 0

    completion = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, max_tokens=20,
                                           temperature=0, logprobs=2).choices[0]
    assert completion.text == expected.text
    torch.testing.assert_close(torch.tensor(completion.logprobs.token_logprobs), torch.tensor(expected.logprobs),
                               atol=1e-4, rtol=1e-4)
    for alternatives, token, row in zip(completion.logprobs.top_logprobs, completion.logprobs.tokens,
                                        expected.top_logprobs):
        assert set(alternatives) == {token} | {tokenizer.decode([a]) for a, _ in row[:2]}


def client_tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server[1].engine.folder)


def test_n_samples_share_the_prompt_and_each_is_a_request_of_its_own(server, offline):
    """n=2: each choice is what one request gives (greedy: plain decoding's; seeded: seed + i's), the siblings read
    the prompt's blocks from the prefix cache, usage sums the samples and lists each one's acceptance."""
    url, loop = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    cached = {}
    engine = loop.engine
    output = engine.output

    def spy(request):
        cached[request.request_id] = request.num_cached_tokens
        return output(request)

    engine.output = spy
    try:
        expected = offline(PROMPTS[10], 24, temperature=0)
        whole = client.chat.completions.create(model=MODEL, messages=PROMPTS[10], max_tokens=24, temperature=0, n=2)
        assert [c.index for c in whole.choices] == [0, 1]
        assert [c.message.content for c in whole.choices] == [expected.text] * 2
        usage = whole.usage
        assert usage.prompt_tokens == len(expected.prompt_token_ids)
        assert usage.completion_tokens == 2 * len(expected.token_ids)
        spec = usage.model_extra["speculative"]
        assert len(spec["samples"]) == 2 and spec["spec_decode_num_drafts"] == sum(
            s["spec_decode_num_drafts"] for s in spec["samples"]) > 0
        block_size = engine.block_size
        assert cached[f"{whole.id}-1"] == len(expected.prompt_token_ids) // block_size * block_size > 0

        streamed = client.chat.completions.create(model=MODEL, messages=PROMPTS[10], max_tokens=24, temperature=0,
                                                  n=2, stream=True, stream_options={"include_usage": True})
        texts, finish_reasons, usage = ["", ""], [None, None], None
        for chunk in streamed:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                finish_reasons[choice.index] = choice.finish_reason or finish_reasons[choice.index]
        assert texts == [expected.text] * 2 and finish_reasons == [expected.finish_reason] * 2
        assert usage.completion_tokens == 2 * len(expected.token_ids)

        pair = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9,
                                         seed=11, n=2)
        alone = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9,
                                           seed=seed).choices[0].text for seed in (11, 12)]
        assert [c.text for c in pair.choices] == alone and alone[0] != alone[1]
    finally:
        del engine.output
    assert engine_state(loop)[1:] == (0, False)


def test_n_samples_with_a_drafter_keep_the_target_law(v8_target, tmp_path_factory):
    """n samples of one request, each speculating with a sampling drafter: every position's law is the target's
    (total variation within the noise floor of 3,000 draws)."""
    from test_spec import exact_marginals, tv
    from transformers import AutoModelForCausalLM

    draft = targets.build_tiny_model(tmp_path_factory.mktemp("v8_draft_n"), "llama", seed=1, vocab_size=8,
                                     initializer_range=0.3)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "draft_temperature": 1.0}
    engine = Engine(EngineConfig(str(v8_target), block_size=4, num_blocks=2048, max_model_len=64, max_num_seqs=128,
                                 max_num_batched_tokens=4096, speculative_config=spec))
    prompt, depth, n, num_requests = [3, 5, 1, 7, 2, 2, 6, 0, 4], 4, 150, 20
    with running(build_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answers = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=depth, temperature=1.0, n=n,
                                             seed=i * n, extra_body={"ignore_eos": True, "return_token_ids": True})
                   for i in range(num_requests)]
    tokens = torch.tensor([c.model_extra["token_ids"] for a in answers for c in a.choices])
    assert tokens.shape == (n * num_requests, depth)
    spec_usage = [a.usage.model_extra["speculative"] for a in answers]
    assert all(len(s["samples"]) == n for s in spec_usage)
    accepted = sum(s["spec_decode_num_accepted_tokens"] for s in spec_usage)
    assert 0 < accepted < sum(s["spec_decode_num_draft_tokens"] for s in spec_usage)
    hf = AutoModelForCausalLM.from_pretrained(v8_target, dtype=torch.float32).eval()
    laws = exact_marginals(hf, prompt, SamplingParams(temperature=1.0, max_tokens=depth), depth)
    distances = [tv(torch.bincount(tokens[:, j], minlength=8), laws[j]) for j in range(depth)]
    # seeded noise over 3,000 draws is ~0.015; a wrong law reaches ~0.08
    assert max(distances) < 0.05, f"TV per generated position {distances}"
    assert float(laws[0].max()) > 0.2


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def streamed_tool_calls(stream) -> tuple[dict, str, object]:
    """{index: (id, name, arguments joined)} of a streamed choice 0, its finish reason and the usage."""
    calls, finish_reason, usage = {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for call in choice.delta.tool_calls or []:
                known = calls.setdefault(call.index, [call.id, call.function.name, ""])
                known[2] += call.function.arguments or ""
    return {i: tuple(c) for i, c in calls.items()}, finish_reason, usage


def test_named_and_required_tools_are_structured_outputs_that_speculate(server, offline):
    """A named function's arguments and "required"'s calls are the schema-constrained answers plain decoding gives,
    in OpenAI's shape, whole and streamed, with drafts verified."""
    from serving.server.tools import tool_call_schema
    from serving.server.protocol import NamedToolChoice, Tool

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in the capital of Italy?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    arguments = offline(messages, 48, temperature=0, structured_outputs={"json": WEATHER["function"]["parameters"],
                                                                         "disable_any_whitespace": True})
    assert arguments.finish_reason == "stop" and json.loads(arguments.text)["city"] in ("Paris", "Rome", "Oslo")
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                           max_tokens=48, temperature=0)
    choice = whole.choices[0]
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", arguments.text)
    assert call.id and choice.finish_reason == "stop" and not choice.message.content
    assert whole.usage.model_extra["speculative"]["spec_decode_num_draft_tokens"] > 0
    calls, finish_reason, _ = streamed_tool_calls(client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named, max_tokens=48, temperature=0,
        stream=True))
    assert list(calls) == [0] and calls[0][1:] == ("get_weather", arguments.text) and finish_reason == "stop"

    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    expected = offline(messages, 96, temperature=0, structured_outputs={
        "json": tool_call_schema(tools, "required", False), "disable_any_whitespace": True})
    assert expected.finish_reason == "stop"
    expected_calls = [(c["name"], c["parameters"]) for c in json.loads(expected.text)]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                                           temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and expected_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected_calls
    calls, finish_reason, _ = streamed_tool_calls(client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        max_tokens=96, temperature=0, stream=True))
    assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == expected_calls
    assert finish_reason == "tool_calls"
    assert NamedToolChoice.model_validate(named).function.name == "get_weather"

    # a template that writes no calls this server can read: "auto" is refused, "none" answers as without tools
    with pytest.raises(openai.BadRequestError, match='tool_choice "auto" needs a tool-call parser'):
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    plain = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=12, temperature=0).choices[0]
    assert plain.message.content == offline(messages, 12, temperature=0).text and not plain.message.tool_calls
    with pytest.raises(openai.BadRequestError, match="'get_date', which is not among the tools"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_date"}})


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\n</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{%- endif %}\n"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_auto_tools_are_rendered_and_read_by_the_hermes_parser(target, speculative_config, tmp_path):
    """A chat template with <tool_call> tags gets vLLM's hermes parser: the tools and earlier calls are rendered by
    the template, and calls in the answer come back in OpenAI's shape, whole and streamed."""
    import shutil
    from transformers import AutoTokenizer

    from serving.server.tools import ToolCalls, tool_call_parser

    folder = tmp_path / "hermes"
    shutil.copytree(target, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(folder)
    assert tool_call_parser(HERMES_TEMPLATE) == "hermes" and tool_call_parser(None) is None

    engine = Engine(EngineConfig(str(folder), max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS,
                                 speculative_config=speculative_config))
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "C"})}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "21 degrees"}]
    as_template_reads = [  # Hugging Face's layout: content a string, a call's arguments an object
        {**m, "content": m["content"] or ""} | ({"tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]]} if "tool_calls" in m else {}) for m in messages]
    rendered = tokenizer.apply_chat_template(as_template_reads, tools=[WEATHER], add_generation_prompt=True,
                                             tokenize=False)
    assert '"get_weather"' in rendered and '<tool_call>\n{"name": "get_weather"' in rendered
    expected = engine.generate([tokenizer.encode(rendered, add_special_tokens=False)],
                               SamplingParams(max_tokens=12))[0]
    with running(build_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=12,
                                                temperature=0)
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.choices[0].message.content == expected.text and not answer.choices[0].message.tool_calls

    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}\n</tool_call>'
    content, calls, finish_reason = ToolCalls("auto", None, "hermes").whole(text, "stop")
    assert content == "Let me look." and finish_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "F"})]
    streaming = ToolCalls("auto", None, "hermes")
    pieces = [streaming.delta(text[i:i + 3])[0] for i in range(0, len(text), 3)]
    rest, calls, finish_reason = streaming.finish("stop")
    assert "".join(pieces) + rest == "Let me look." and finish_reason == "tool_calls" and len(calls) == 1
    assert ToolCalls("auto", None, "hermes").whole("No call here <tool", "length") == ("No call here <tool", [],
                                                                                      "length")


def test_detokenizer_deltas_add_up_to_the_final_text():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(targets.resolve(targets.DEFAULT_TARGET))
    ids = tokenizer.encode("Grüße aus Köln 🎉 und dann STOP, danach nichts mehr", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, ["STOP"])
    deltas = [detokenizer.add([token]) for token in ids]
    assert not any("\ufffd" in delta or "ST" in delta for delta in deltas)
    final = tokenizer.decode(ids).split("STOP")[0]
    assert "".join(deltas) + detokenizer.finish(final) == final == "Grüße aus Köln 🎉 und dann "


def test_arrivals_are_poisson_and_seeded():
    times = arrival_times(4000, 8.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / 8) < 0.01 and min(gaps) >= 0
    assert arrival_times(5, 8.0, seed=1) == arrival_times(5, 8.0, seed=1) != arrival_times(5, 8.0, seed=2)
    assert arrival_times(3, float("inf"), seed=0) == [0.0] * 3


def test_bench_serve_reads_the_offline_acceptance_through_metrics(server, target, speculative_config, tmp_path):
    """Greedy, with a roomy token budget, drafts do not depend on the batch: the acceptance bench-serve reads from
    the /metrics counters equals the offline engine's on the same prompts, count for count."""
    url, _ = server
    prompts = PROMPTS[:6]
    config = BenchServeConfig(endpoint=url, num_prompts=6, max_new_tokens=24, request_rate=40.0, max_concurrency=4,
                              seed=3)
    schedule = arrival_times(6, config.request_rate, config.seed)
    runs = [measure(url, prompts, schedule, config, "tiny"), measure(url, prompts, schedule, config, "again")]
    engine = Engine(EngineConfig(str(target), max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS,
                    speculative_config=speculative_config))
    stats = AcceptanceStats()
    for output in engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0)):
        stats.merge(AcceptanceStats.from_dict(output.metrics["spec"]))
    for run in runs:
        assert (run["model"], run["num_completed"], run["num_failed"]) == (MODEL, 6, 0)
        accepted = run["acceptance"]
        assert (accepted["num_drafts"], accepted["num_draft_tokens"], accepted["num_accepted_tokens"]) == (
            stats.num_drafts, stats.num_draft_tokens, sum(stats.accepted))
        assert accepted["num_accepted_per_position"] == stats.accepted
        assert accepted["tau"] == pytest.approx(stats.tau)
        for name in ("ttft", "tpot", "itl", "e2e"):
            latency = run["latency_ms"][name]
            assert 0 <= latency["median"] <= latency["p99"], name
        assert run["output_throughput"] > 0
    report = make_report(runs, config)
    assert report["ratios"]["output_throughput"] == pytest.approx(
        runs[0]["output_throughput"] / runs[1]["output_throughput"])
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == ["bench_serve.json", "bench_serve.md", "latency.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert "| tiny | 6/6 |" in paths[1].read_text()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in PROMPTS))
    return path


def test_bench_serve_command_writes_its_report(server, prompts_file, tmp_path, capsys):
    from training.cli import main

    url, _ = server
    assert main(["bench-serve", "--endpoint", f"{url}/v1", "--prompts", str(prompts_file), "--num-prompts", "4",
                 "--max-new-tokens", "8", "--request-rate", "inf", "--api", "completions", "--out",
                 str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_serve.json").read_text())
    assert report["runs"][0]["num_completed"] == 4 and report["api"] == "completions"
    assert "| 4/4 |" in capsys.readouterr().out
    assert main(["bench-serve", "--endpoint", "localhost:8000"]) == 2
    assert "is not a URL" in capsys.readouterr().err


@pytest.mark.e2e  # two server processes and a load run
def test_serve_and_bench_starts_measures_and_stops_both_servers(target, prompts_file, tmp_path):
    """The function `make demo` calls: the real command twice, speculative and plain."""
    report = serve_and_bench(str(target), {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                           "prompt_lookup_max": 3}, prompts=str(prompts_file),
                             num_prompts=3, max_new_tokens=8, request_rate=50.0, out=tmp_path,
                             serve_options=["--max-model-len", "256", "--num-threads", "1"])
    assert [run["label"] for run in report["runs"]] == ["ngram", "plain"]
    assert all(run["num_completed"] == 3 for run in report["runs"])
    assert report["runs"][0]["acceptance"]["num_drafts"] > 0 and report["runs"][1]["acceptance"] is None
    assert report["ratios"]["output_throughput"] > 0 and (tmp_path / "latency.png").is_file()


@pytest.mark.e2e  # a server process, stopped mid-run
def test_sigterm_mid_run_exits_zero_without_traceback(target):
    """The real command: requests too long to finish in the shutdown timeout are in flight when SIGTERM comes."""
    timeout = 2.0
    command = [sys.executable, "-m", "training", "serve", "--target", str(target), "--port", "0", "--max-model-len",
               "4096", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--shutdown-timeout",
               str(timeout), "--served-model-name", MODEL]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None:
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            line = process.stderr.readline()
            lines.append(line)
            if "on http://" in line:
                url = line.rsplit(" ", 1)[1].strip()
        reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
        reader.start()
        received = [[] for _ in range(3)]

        def client(i):
            body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/completions", json=body,
                                                                     timeout=60) as response:
                received[i].extend(line for line in response.iter_lines() if line)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in clients:
            thread.start()
        while not all(len(r) > 5 for r in received):
            assert time.monotonic() < deadline, "no tokens came"
            time.sleep(0.05)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout + 20)
        elapsed = time.monotonic() - start
        for thread in clients:
            thread.join(10)
        reader.join(5)
    finally:
        if process.poll() is None:
            process.kill()
    log = "".join(lines)
    assert returncode == 0, log
    assert elapsed < timeout + 10, f"exit took {elapsed:.1f} s"
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    for stream in received:  # each response ended properly: the shutdown error event, then [DONE]
        assert stream[-1] == "data: [DONE]" and "shut down" in stream[-2], stream[-2:]


# ---- scoring a prompt: echo and prompt_logprobs ------------------------------------------------------------------


def reference_logprobs(target, ids: list[int]) -> torch.Tensor:
    """transformers' forward over `ids`: [len(ids), vocab] the log-softmax at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def scored_prompt(target) -> list[int]:
    return torch.randint(3, 4000, (41,), generator=torch.Generator().manual_seed(5)).tolist()


def test_the_engine_scores_a_prompt_over_chunks_and_takes_no_cached_blocks_for_it(target):
    """Prompt logprobs are computed in prefill, chunk by chunk (16 tokens a step here), equal to transformers' log
    softmax at the row before each token; a request asking for them computes its whole prompt even where the prefix
    cache holds it, and a preempted request's recomputation writes the same values."""
    ids = scored_prompt(target)
    reference = reference_logprobs(target, ids)
    engine = Engine(EngineConfig(str(target), max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS, block_size=8,
                                 max_num_batched_tokens=16))
    [plain] = engine.generate([ids], SamplingParams(max_tokens=2))
    [scored] = engine.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=3))
    [cached] = engine.generate([ids], SamplingParams(max_tokens=2))
    assert cached.metrics["num_cached_tokens"] > 0 and scored.metrics["num_cached_tokens"] == 0
    assert plain.prompt_logprobs is None and scored.token_ids == plain.token_ids
    prompt = scored.prompt_logprobs
    assert len(prompt) == len(ids) and prompt[0] is None
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor([p[0] for p in prompt[1:]]), expected, rtol=0, atol=1e-4)
    ranks = (reference[:-1] > expected[:, None]).sum(-1) + 1
    assert [p[1] for p in prompt[1:]] == ranks.tolist()
    top = reference[:-1].topk(3, -1)
    assert [[t for t, _ in p[2]] for p in prompt[1:]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in p[2]] for p in prompt[1:]]), top.values, rtol=0, atol=1e-4)


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_lm_eval_asks(server, target):
    """lm-eval-harness's loglikelihood request (echo, logprobs, max_tokens 0) with the openai client, against a
    prompt the prefix cache already holds: the text is the prompt, the logprobs the target's (transformers' log
    softmax), the first token's None; vLLM's prompt_logprobs beside them; with max_tokens > 0 the answer follows."""
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    tokenizer = client_tokenizer(server)
    ids = scored_prompt(target)
    reference = reference_logprobs(target, ids)
    client.completions.create(model=MODEL, prompt=ids, max_tokens=1)  # its blocks are cached now
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), expected, rtol=0, atol=1e-4)
    for row, alternatives, token in zip(reference[:-1], logprobs.top_logprobs[1:], logprobs.tokens[1:]):
        best = row.topk(2)
        assert {tokenizer.decode([t]) for t in best.indices.tolist()} | {token} == alternatives.keys()
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    first = prompt_logprobs[1][str(ids[1])]
    assert first["decoded_token"] == tokenizer.decode([ids[1]])
    assert abs(first["logprob"] - expected[0].item()) < 1e-4 and first["rank"] == int((reference[0] > expected[0]).sum()) + 1

    text = "Score this sentence, then carry on:"
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, logprobs=0)
    echoed = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, logprobs=0, echo=True)
    assert echoed.choices[0].text == text + plain.choices[0].text
    num_prompt = echoed.usage.prompt_tokens
    assert echoed.choices[0].logprobs.token_logprobs[num_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert len(echoed.choices[0].logprobs.tokens) == num_prompt + 6 and "prompt_logprobs" not in plain.choices[0].model_extra


@pytest.mark.parametrize("body, message, param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens=0 generates nothing", "max_tokens"),
    ({"prompt": "hi", "echo": True, "stream": True}, "echo is only supported for whole answers", "echo"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs=21 is invalid", "prompt_logprobs"),
])
def test_scoring_requests_it_cannot_serve_are_refused_by_name(server, body, message, param):
    url, _ = server
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
