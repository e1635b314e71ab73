"""The engine end to end against Hugging Face transformers.

Greedy tokens equal transformers' `generate` token for token: tiny models (EOS ignored on both sides so
every request runs its full length), mixed batches arriving at different steps, forced preemption,
prefix-cache hits, chunked prefill, and the real default target on MT-bench first turns. Then seeded
sampling, stop conditions, logprobs, hidden-state capture, and bad input that fails only the request
that carries it.
"""
from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving import targets
from serving import kernels
from serving.attention import KVCache
from serving.config import EngineConfig
from serving.engine import Engine, available_memory_bytes
from serving.bench.prompts import first_turn, load_prompts
from serving.request import SamplingParams


TINY = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_llama_rope3", "tiny_qwen3_moe", "tiny_gemma3", "tiny_gpt_oss"]
VOCAB = 256  # the tiny fixtures' vocabulary
EOS = 2  # the tiny fixtures' eos token


# ---- references ----------------------------------------------------------------------------------------

_HF_MODELS: dict = {}


def hf_model(folder):
    key = str(folder)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _HF_MODELS[key]


@torch.no_grad()
def hf_greedy(folder, prompt, max_new_tokens, ignore_eos=True):
    """transformers' greedy `generate`; with ignore_eos, EOS is switched off so it runs max_new_tokens."""
    model = hf_model(folder)
    config = copy.deepcopy(model.generation_config)
    config.pad_token_id = 0
    if ignore_eos:
        config.eos_token_id = []  # None falls back to the model config's EOS
    out = model.generate(torch.tensor([prompt]), generation_config=config, max_new_tokens=max_new_tokens,
                         do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    if ignore_eos:
        assert len(tokens) == max_new_tokens  # transformers did not stop early
    return tokens


def random_prompt(length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def tiny_engine(folder, **kwargs):
    settings = dict(block_size=4, num_blocks=128, max_model_len=256)
    settings.update(kwargs)
    return Engine(EngineConfig(str(folder), **settings))


def greedy(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_arrivals(engine, arrivals):
    """arrivals: {step index: [(prompt, params), ...]}. Adds requests when their step comes, steps until
    everything finishes, and returns {request id: output} plus the ids in arrival order."""
    outputs, ids, step = {}, [], 0
    last = max(arrivals)
    while step <= last or engine.has_unfinished():
        for prompt, params in arrivals.get(step, []):
            ids.append(engine.add_request(prompt, params))
        for output in engine.step():
            assert output.request_id not in outputs
            outputs[output.request_id] = output
        step += 1
    return outputs, ids


def assert_no_blocks_held(engine):
    assert all(group.num_free_blocks == group.num_blocks for group in engine.block_manager.groups)
    assert not engine.requests and not engine.has_unfinished()


# ---- greedy equals transformers ------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", TINY)
def test_greedy_mixed_batch_arriving_over_steps_equals_hf(fixture, request):
    folder = request.getfixturevalue(fixture)
    engine = tiny_engine(folder)
    lengths = [5, 17, 33, 70, 2, 1]  # 70 + new tokens runs past the llama3 original context (64)
    max_tokens = [24, 16, 30, 20, 12, 8]
    prompts = [random_prompt(n, seed) for seed, n in enumerate(lengths)]
    requests = [(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
    arrivals = {0: requests[:2], 3: requests[2:4], 5: requests[4:]}
    outputs, ids = run_arrivals(engine, arrivals)
    for request_id, prompt, num in zip(ids, prompts, max_tokens):
        out = outputs[request_id]
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(folder, prompt, num), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.finished
        assert out.metrics["num_output_tokens"] == num and out.metrics["num_prompt_tokens"] == len(prompt)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_forced_preemption_keeps_greedy_outputs_equal_to_hf(tiny_llama, enable_prefix_caching):
    # 24 blocks of 4 = 96 slots for four requests that grow to 50-60 tokens each.
    engine = tiny_engine(tiny_llama, num_blocks=24, max_model_len=96, enable_prefix_caching=enable_prefix_caching)
    prompts = [random_prompt(n, 100 + i) for i, n in enumerate([20, 25, 18, 30])]
    outputs, ids = run_arrivals(engine, {0: [(p, greedy(30)) for p in prompts[:3]], 2: [(prompts[3], greedy(30))]})
    assert sum(outputs[i].metrics["num_preemptions"] for i in ids) > 0
    for request_id, prompt in zip(ids, prompts):
        assert outputs[request_id].token_ids == hf_greedy(tiny_llama, prompt, 30)
    assert_no_blocks_held(engine)


def test_prefix_cache_hits_keep_outputs_equal_to_hf(tiny_qwen2):
    folder = tiny_qwen2
    engine = tiny_engine(folder, num_blocks=96)
    shared = random_prompt(41, 200)
    first = shared + [7, 8, 9]
    out_first = engine.generate([first], greedy(16))[0]
    assert out_first.metrics["num_cached_tokens"] == 0
    assert out_first.token_ids == hf_greedy(folder, first, 16)

    # A later request sharing 41 tokens reuses the 10 full blocks (40 tokens) of the first.
    second = shared + [11, 12]
    out_second = engine.generate([second], greedy(12))[0]
    assert out_second.metrics["num_cached_tokens"] == 40
    assert out_second.token_ids == hf_greedy(folder, second, 12)

    # The first request's generated tokens were cached too: its prompt plus 10 of its tokens (54 tokens)
    # hits 13 blocks (52 tokens).
    third = first + out_first.token_ids[:10]
    out_third = engine.generate([third], greedy(10))[0]
    assert out_third.metrics["num_cached_tokens"] == 52
    assert out_third.token_ids == hf_greedy(folder, third, 10)

    # The same prompt again: everything but the last block comes from the cache, same tokens.
    out_again = engine.generate([first], greedy(16))[0]
    assert out_again.metrics["num_cached_tokens"] == 40
    assert out_again.token_ids == out_first.token_ids
    assert_no_blocks_held(engine)


def test_prefix_shared_with_a_running_request(tiny_llama):
    """The second request takes blocks the first still holds, while the first keeps decoding."""
    engine = tiny_engine(tiny_llama)
    shared = random_prompt(37, 300)
    a, b = shared + [5], shared + [6, 7, 8]
    outputs, ids = run_arrivals(engine, {0: [(a, greedy(20))], 3: [(b, greedy(20))]})
    assert outputs[ids[1]].metrics["num_cached_tokens"] == 36
    assert outputs[ids[0]].token_ids == hf_greedy(tiny_llama, a, 20)
    assert outputs[ids[1]].token_ids == hf_greedy(tiny_llama, b, 20)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("budget", [8, 5])
def test_chunked_prefill_equals_hf(tiny_qwen3, budget):
    engine = tiny_engine(tiny_qwen3, block_size=3, max_num_batched_tokens=budget)
    prompts = [random_prompt(n, 400 + n) for n in (30, 45, 11)]
    first = engine.add_request(prompts[0], greedy(10))
    engine.step()
    assert engine.requests[first].num_computed_tokens == budget  # the prompt went in as a chunk
    ids = [first] + [engine.add_request(p, greedy(10)) for p in prompts[1:]]
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    for request_id, prompt in zip(ids, prompts):
        assert outputs[request_id].token_ids == hf_greedy(tiny_qwen3, prompt, 10)
    assert_no_blocks_held(engine)


LONG_TURN = [{"role": "user", "content": "Summarize this: " + " ".join(
    f"Sentence {i} says that the river {'rose' if i % 3 else 'fell'} by {i % 7} inches." for i in range(60))}]


@pytest.mark.slow
@pytest.mark.parametrize("target, num_prompts", [(targets.DEFAULT_TARGET, 8), (targets.GEMMA3_TARGET, 3)])
def test_real_targets_on_mt_bench_equal_hf_generate(target, num_prompts):
    """The real built-in targets, float32, MT-bench first turns and one turn longer than Gemma 3's 512-key windows x
    32 new tokens, batched in the engine; prompt ids from the same chat template. transformers generates all in one
    left-padded batch; a prompt whose tokens differ there is generated again alone (padding can move float32
    logits), and that is the reference."""
    folder = targets.resolve(target)
    messages = [first_turn(row["messages"]) for row in load_prompts("mt-bench", limit=num_prompts)] + [LONG_TURN]
    engine = Engine(EngineConfig(target, dtype="float32", block_size=16, num_blocks=256, max_model_len=1024))
    outputs = engine.generate(messages, SamplingParams(max_tokens=32))

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"])
               for m in messages]
    assert [out.prompt_token_ids for out in outputs] == prompts
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    assert eos == set(engine.model.config.eos_token_ids)
    pad = 0 if model.generation_config.pad_token_id is None else model.generation_config.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=pad)
    for i, (message, prompt, out) in enumerate(zip(messages, prompts, outputs)):
        expected = batched[i, width:].tolist()
        stops = [k for k, t in enumerate(expected) if t in eos]
        expected = expected[:stops[0] + 1] if stops else expected
        if out.token_ids != expected:
            with torch.no_grad():
                alone = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=pad)
            expected = alone[0, len(prompt):].tolist()
        assert out.token_ids == expected, f"prompt {i}: {message[0]['content'][:60]!r}"
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if expected[-1] in eos else "length")


# ---- seeded sampling -----------------------------------------------------------------------------------

SAMPLING = [
    dict(temperature=0.8),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.8, top_k=50),
    dict(temperature=0.8, min_p=0.05),
    dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05),
]


@pytest.mark.parametrize("settings", SAMPLING, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(tiny_llama, settings):
    prompt = random_prompt(12, 500)

    def params(seed):
        return SamplingParams(max_tokens=24, ignore_eos=True, seed=seed, **settings)

    engine = tiny_engine(tiny_llama)
    alone = engine.generate([prompt], params(1234))[0].token_ids
    again = tiny_engine(tiny_llama).generate([prompt], params(1234))[0].token_ids
    assert alone == again

    others = [(random_prompt(5 + 3 * i, 600 + i), params(i) if i % 2 else greedy(10 + i)) for i in range(8)]
    outputs, ids = run_arrivals(engine, {0: others[:4], 1: [(prompt, params(1234))], 2: others[4:]})
    assert outputs[ids[4]].token_ids == alone

    different = engine.generate([prompt], params(4321))[0].token_ids
    assert different != alone
    assert len(set(alone)) > 5  # really sampled, not stuck on one token


def test_seeded_sampling_survives_preemption(tiny_llama):
    prompt = random_prompt(20, 700)
    params = SamplingParams(max_tokens=30, ignore_eos=True, seed=7, temperature=1.0, top_p=0.95)
    alone = tiny_engine(tiny_llama).generate([prompt], params)[0].token_ids
    engine = tiny_engine(tiny_llama, num_blocks=20, max_model_len=80)
    crowd = [(random_prompt(22, 710 + i), greedy(30)) for i in range(3)]
    outputs, ids = run_arrivals(engine, {0: [(prompt, params)] + crowd})
    assert sum(o.metrics["num_preemptions"] for o in outputs.values()) > 0
    assert outputs[ids[0]].token_ids == alone


# ---- stop conditions -----------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(tiny_llama):
    out = tiny_engine(tiny_llama).generate([random_prompt(9, 800)], greedy(7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and out.finished


def test_max_model_len_finishes_with_length(tiny_llama):
    prompt = random_prompt(30, 801)
    out = tiny_engine(tiny_llama, max_model_len=40).generate([prompt], greedy(100))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(tiny_llama, prompt, 10)


def test_stop_token_ids(tiny_llama):
    prompt = random_prompt(9, 802)
    reference = hf_greedy(tiny_llama, prompt, 24)
    stop = reference[6]
    cut = reference.index(stop) + 1  # the stop token is emitted, nothing after it
    out = tiny_engine(tiny_llama).generate([prompt], greedy(24, stop_token_ids=[999, stop]))[0]
    assert out.token_ids == reference[:cut] and out.finish_reason == "stop"


@pytest.fixture
def eos_model(tiny_llama, tmp_path):
    """tiny_llama's weights with eos set to tokens its greedy answer to PROMPT_EOS emits."""
    reference = hf_greedy(tiny_llama, PROMPT_EOS, 24)
    eos = [reference[8], reference[5]]
    folder = tmp_path / "eos_model"
    shutil.copytree(tiny_llama, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(config))
    return folder, reference, eos


PROMPT_EOS = random_prompt(10, 803)


def test_eos_stops_like_hf_generate(eos_model):
    folder, reference, eos = eos_model
    cut = min(reference.index(t) for t in eos) + 1
    hf = hf_greedy(folder, PROMPT_EOS, 24, ignore_eos=False)
    assert hf == reference[:cut]  # transformers stops at the first of either eos token
    engine = tiny_engine(folder)
    out = engine.generate([PROMPT_EOS], SamplingParams(max_tokens=24))[0]
    assert out.token_ids == hf and out.finish_reason == "stop"
    ignored = engine.generate([PROMPT_EOS], greedy(24))[0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


@pytest.fixture(scope="module")
def debug_engine():
    """The `debug` target: a tiny random Llama with the default target's tokenizer, for text and stop strings."""
    return Engine(EngineConfig("debug", block_size=16, num_blocks=64, max_model_len=512))


def test_stop_strings_cut_text_before_the_stop(debug_engine):
    engine = debug_engine
    tokenizer = engine.tokenizer
    prompt = "Once upon a time"
    reference = engine.generate([prompt], greedy(24))[0].token_ids
    full = tokenizer.decode(reference, skip_special_tokens=True)
    boundary = len(tokenizer.decode(reference[:10], skip_special_tokens=True))
    stop = full[boundary - 2:boundary + 2]  # spans two tokens
    assert len(stop.strip()) > 0

    def expected(stops):
        for k in range(1, len(reference) + 1):
            text = tokenizer.decode(reference[:k], skip_special_tokens=True)
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                return reference[:k], text[:min(hits)]
        raise AssertionError("no stop string in the reference")

    for stops in ([stop], ["never appears in this text", stop], stop):
        out = engine.generate([prompt], greedy(24, stop=stops))[0]
        tokens, text = expected([stops] if isinstance(stops, str) else stops)
        assert out.finish_reason == "stop"
        assert out.token_ids == tokens and len(tokens) < len(reference)
        assert out.text == text
        assert stop not in out.text and full.startswith(out.text)

    out = engine.generate([prompt], greedy(24, stop=["never appears in this text"]))[0]
    assert out.finish_reason == "length" and out.text == full


# ---- logprobs and hidden states ------------------------------------------------------------------------


def test_greedy_logprobs_equal_log_softmax_of_hf_logits(tiny_qwen3):
    prompt = random_prompt(15, 900)
    engine = tiny_engine(tiny_qwen3)
    out = engine.generate([prompt], greedy(12, logprobs=True))[0]
    assert out.token_ids == hf_greedy(tiny_qwen3, prompt, 12)
    with torch.no_grad():
        logits = hf_model(tiny_qwen3)(torch.tensor([prompt + out.token_ids])).logits[0]
    rows = logits[len(prompt) - 1:-1].float().log_softmax(-1)  # the distribution each output token was drawn from
    expected = rows.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert out.logprobs is not None and len(out.logprobs) == 12
    torch.testing.assert_close(torch.tensor(out.logprobs), expected)
    assert engine.generate([prompt], greedy(4))[0].logprobs is None


def test_captured_hidden_states_equal_hf(tiny_llama):
    prompt = random_prompt(21, 901)
    engine = tiny_engine(tiny_llama, capture_hidden=True, aux_layers=(1, 3))
    out = engine.generate([prompt], greedy(9))[0]
    sequence = prompt + out.token_ids
    with torch.no_grad():
        hf = hf_model(tiny_llama)(torch.tensor([sequence]), output_hidden_states=True)
    assert out.hidden.shape == (len(sequence), 64)
    torch.testing.assert_close(out.hidden, hf.hidden_states[-1][0])
    for layer in (1, 3):
        torch.testing.assert_close(out.aux[layer], hf.hidden_states[layer][0])


@pytest.mark.skipif(kernels.library() is None, reason="the kernels do not build here")
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_a_rows_states_do_not_depend_on_the_prefill_chunk_that_computed_them(fixture, request):
    """Where the C kernel attends, prefill chunks attend row by row as decode steps do: a sequence's states are the
    same bits prefilled at once (40 rows), in chunks of 8 or 5 tokens (the scheduler's budget), or one token a step
    as decode steps compute them (a preempted request prefilled again gives back its bits)."""
    folder = request.getfixturevalue(fixture)
    sequence = random_prompt(40, 902)
    states = []
    for budget in (64, 8, 5, 1):
        engine = tiny_engine(folder, capture_hidden=True, aux_layers=(2,), max_num_batched_tokens=budget)
        out = engine.generate([sequence], greedy(1))[0]
        states.append((out.hidden[:len(sequence)], out.aux[2][:len(sequence)]))
    for hidden, aux in states[1:]:
        assert torch.equal(hidden, states[0][0]) and torch.equal(aux, states[0][1])


@pytest.mark.parametrize("device, message", [
    ("gpu0", "device='gpu0' is not a device: use auto, cpu, cuda or cuda:N"),
    ("meta", "device='meta': the engine runs on cpu or cuda"),
    pytest.param("cuda", "device='cuda' but this torch build sees no CUDA GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA GPU is there")),
])
def test_a_device_the_engine_cannot_run_on_is_a_clear_error(tiny_llama, device, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_engine(tiny_llama, device=device)


def test_auto_device_is_the_gpu_when_torch_sees_one(tiny_llama):
    assert tiny_engine(tiny_llama).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_capture_names_its_device_and_keeps_states_in_host_memory(tiny_llama, device_unnamed_is_meta):
    """Captured states go to a store: they are CPU tensors, equal with unnamed devices on meta (the check that every
    tensor the engine makes names its device) to those of a run with the CPU by default."""
    prompts = [random_prompt(n, 910 + n) for n in (5, 21, 40)]

    def run():
        engine = tiny_engine(tiny_llama, capture_hidden=True, aux_layers=(1, 3), max_num_batched_tokens=16, device="cpu")
        return engine.generate(prompts, greedy(9))

    expected = run()
    with device_unnamed_is_meta():
        got = run()
    for out, ref in zip(got, expected):
        assert out.token_ids == ref.token_ids and out.hidden.device.type == "cpu"
        assert torch.equal(out.hidden, ref.hidden) and all(torch.equal(out.aux[i], ref.aux[i]) for i in (1, 3))


# ---- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", dict(temperature=-0.1)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-1)),
        ("max_tokens", dict(max_tokens=0)),
        ("min_p", dict(min_p=1.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("stop", dict(stop=123)),
        ("stop", dict(stop=[1, 2])),
        ("stop", dict(stop=[""])),
        ("stop_token_ids", dict(stop_token_ids=["a"])),
        ("seed", dict(seed="abc")),
        ("seed", dict(seed=2**70)),
        ("seed", dict(seed=-1)),
        ("seed", dict(seed=3.0)),
        ("temperature", dict(temperature=True)),
        ("temperature", dict(temperature="0.7")),
        ("temperature", dict(temperature=float("nan"))),
        ("max_tokens", dict(max_tokens=True)),
        ("top_p", dict(top_p=None)),
        ("presence_penalty", dict(presence_penalty="1")),
    ],
)
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"\b{field}=") as info:
        SamplingParams(**kwargs)
    assert f"SamplingParams.{field}" in str(info.value)


def test_bad_requests_fail_alone_while_others_finish(tiny_llama):
    engine = tiny_engine(tiny_llama, max_model_len=64)
    good = [random_prompt(n, 1000 + n) for n in (12, 30)]
    ids = [engine.add_request(p, greedy(15)) for p in good]
    engine.step()
    engine.step()
    bad = [
        (random_prompt(64, 1), r"prompt has 64 tokens but max_model_len is 64"),
        (random_prompt(100, 2), r"max_model_len"),
        ([], r"prompt is empty"),
        ([5, VOCAB], r"prompt token ids must lie in \[0, 256\)"),
        ([-1, 5], r"prompt token ids"),
        ("a string prompt", r"no tokenizer"),
        ([{"role": "user", "content": "hi"}], r"chat template"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, greedy(5))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6], greedy(5), request_id=ids[0])
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([5, 6], SamplingParams(temperature=-1.0))
    assert sorted(engine.requests) == sorted(ids)
    assert len(engine.scheduler.running) + len(engine.scheduler.waiting) == 2

    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    for request_id, prompt in zip(ids, good):
        assert outputs[request_id].finish_reason == "length"
        assert outputs[request_id].token_ids == hf_greedy(tiny_llama, prompt, 15)
    assert_no_blocks_held(engine)


def test_generate_validates_every_prompt_before_starting(tiny_llama):
    engine = tiny_engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1\b"):
        engine.generate([[5, 6, 7], [], [8, 9]], greedy(3))
    with pytest.raises(ValueError, match=r"prompt 2\b.*max_model_len"):
        engine.generate([[5, 6, 7], [8], list(range(3, 70))], greedy(3))
    assert not engine.has_unfinished() and not engine.requests
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine.generate([[5], [6], [7]], [greedy(3), greedy(3)])


def test_generate_checks_token_ids_of_every_prompt_before_starting(tiny_llama):
    """An out-of-vocabulary id in a later prompt must fail before the earlier prompts enter the engine."""
    engine = tiny_engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1\b.*\[0, 256\)"):
        engine.generate([[5, 6], [5, VOCAB]], greedy(3))
    assert not engine.requests and not engine.has_unfinished()


def finish_all(engine):
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_stop_strings_without_a_tokenizer_fail_that_request_only(tiny_llama):
    """The tiny fixtures have no tokenizer, so a stop string can never be matched: a ValueError naming `stop`
    at add_request, and the request already running finishes."""
    engine = tiny_engine(tiny_llama)
    good = engine.add_request([5, 6, 7], greedy(5))
    engine.step()
    with pytest.raises(ValueError, match=r"\bstop\b"):
        engine.add_request([8, 9], greedy(5, stop=["ab"]))
    outputs = finish_all(engine)
    assert outputs[good].token_ids == hf_greedy(tiny_llama, [5, 6, 7], 5)
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("bias", [{VOCAB: 1.0}, {-1: 1.0}, {10**6: -5.0}])
def test_logit_bias_outside_the_vocabulary_fails_that_request_only(tiny_llama, bias):
    engine = tiny_engine(tiny_llama)
    good = engine.add_request([5, 6, 7], greedy(5))
    engine.step()
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([8, 9], greedy(5, logit_bias=bias))
    outputs = finish_all(engine)
    assert outputs[good].token_ids == hf_greedy(tiny_llama, [5, 6, 7], 5)
    assert_no_blocks_held(engine)


def test_too_many_kv_blocks_is_a_clear_error_with_the_number_that_fits(tiny_llama):
    with pytest.raises(ValueError, match=r"num_blocks=1000000000000 needs .* GiB") as info:
        tiny_engine(tiny_llama, num_blocks=10**12)
    fits = int(re.search(r"at most (\d+) blocks of 4 tokens fit", str(info.value)).group(1))
    bytes_per_block = KVCache.bytes_per_block(4, 4, 2, 16, torch.float32)
    assert 0 < fits * bytes_per_block <= available_memory_bytes(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"at most \d+ blocks"):
        tiny_engine(tiny_llama, num_blocks=None, kv_cache_memory_gib=10**6)


def test_max_model_len_is_refused_below_two_and_lowered_to_the_model_s_with_a_warning(tiny_llama, caplog):
    for bad in (-5, 0, 1, 64.0, True):
        with pytest.raises(ValueError, match=rf"max_model_len={bad!r} must be an integer >= 2"):
            tiny_engine(tiny_llama, max_model_len=bad)
    with caplog.at_level("WARNING", logger="serving.engine"):
        engine = tiny_engine(tiny_llama, max_model_len=4096)
    assert engine.max_model_len == 512  # the tiny models' max_position_embeddings
    assert "max_model_len=4096 exceeds the target's max_position_embeddings (512): serving 512 tokens" in caplog.text
    assert tiny_engine(tiny_llama, max_model_len=None).max_model_len == 512


def test_bad_engine_settings(tiny_llama):
    with pytest.raises(ValueError, match="dtype='float8'"):
        tiny_engine(tiny_llama, dtype="float8")
    with pytest.raises(ValueError, match=r"max_model_len=256 exceeds the K/V pool \(32 tokens\)"):
        tiny_engine(tiny_llama, num_blocks=8)
