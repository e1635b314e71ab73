"""`draftheads generate`: one engine pass yields the hidden states a teacher-forced transformers forward gives,
the loss mask covers exactly the target's answers as the chat template lays them out, a run killed mid-way
resumes to the store an uninterrupted run writes, and bad settings fail clearly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.targets import DEFAULT_TARGET, resolve
from training.cli import main as cli
from training.data.chat import template_ids_after_answer, user_turns
from training.data.generate import GenerateConfig, generate
from training.data.store import Store, rows_file

ROOT = Path(__file__).resolve().parents[2]
CONVERSATIONS = [
    {"id": "two-turns", "messages": [
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "The dataset's answer, which the target never sees."},
        {"role": "user", "content": "Which of them is the warmest?"}]},
    {"id": "system", "category": "math", "messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is seven times six?"},
        {"role": "user", "content": "And seven times seven?"}]},
    {"id": "one-turn", "prompt": "Write a haiku about the sea."},
]


def messages_of(conversation: dict) -> list[dict]:
    return conversation.get("messages") or [{"role": "user", "content": conversation["prompt"]}]


def write_prompts(path: Path, conversations) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


@pytest.fixture(scope="module")
def debug_store(tmp_path_factory):
    """All turns of a few conversations on the debug target, prefilled in chunks of 16 tokens, 3 at a time."""
    folder = tmp_path_factory.mktemp("debug_store")
    prompts = write_prompts(folder / "prompts.jsonl", CONVERSATIONS + [
        {"id": f"extra-{i}", "prompt": "Tell me about the number " + "seven " * (4 * i)} for i in range(3)])
    config = GenerateConfig(prompts=str(prompts), out=str(folder / "store"), target="debug", turns="all",
                            max_new_tokens=12, concurrency=3, max_num_batched_tokens=16, shard_size=4)
    summary = generate(config, progress=False)
    return folder / "store", summary


def test_one_pass_hidden_states_equal_a_teacher_forced_forward(debug_store):
    path, summary = debug_store
    store = Store(path, target_fingerprint=json.loads((path / "meta.json").read_text())["target"]["fingerprint"])
    assert len(store) == summary["num_examples"] == 6 and store.aux_layers == (2, 2, 1)  # (2, L//2, L-3) for L=4
    model = AutoModelForCausalLM.from_pretrained(resolve("debug"), dtype=torch.float32).eval()
    for item in store:
        with torch.no_grad():
            states = model(item["input_ids"][None], output_hidden_states=True).hidden_states  # [1, T, hidden] each
        # hidden_states[i] is the input of layer i; hidden_states[-1] comes after the final norm.
        eagle3 = torch.cat([states[i][0] for i in (2, 2, 1)], dim=-1)  # [T, 3 * hidden]
        torch.testing.assert_close(item["hidden"]["last"], states[-1][0].to(torch.bfloat16))
        torch.testing.assert_close(item["hidden"]["eagle3"], eagle3.to(torch.bfloat16))
    lengths = store.table["length"]
    assert max(lengths) > 2 * 16, "no prompt was long enough to be prefilled in chunks"
    assert summary["num_answer_tokens"] == sum(sum(mask) for mask in store.table["loss_mask"])
    assert summary["bytes_per_token_per_layer"] == pytest.approx(2 * 128, rel=0.05)


def test_template_ids_after_an_answer_equal_the_rendered_conversation():
    tokenizer = AutoTokenizer.from_pretrained(resolve("debug"))
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    following = [{"role": "user", "content": "Bye now"}]
    answer = "Hello! How can I help?"
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    prompt_ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt_ids, add_special_tokens=False)
    whole = tokenizer.apply_chat_template(history + [{"role": "assistant", "content": answer}] + following,
                                          add_generation_prompt=True, tokenize=False)
    whole = tokenizer.encode(whole, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stopped = prompt_ids + answer_ids + [eos]  # the answer ended on its stop token
    assert stopped + template_ids_after_answer(tokenizer, history, following, eos) == whole
    cut = prompt_ids + answer_ids  # the answer ran out of tokens: the template closes it
    assert cut + template_ids_after_answer(tokenizer, history, following, None) == whole


def test_user_turns_drop_the_datasets_answers():
    messages = CONVERSATIONS[1]["messages"] + [{"role": "assistant", "content": "x"}, {"role": "system", "content": "y"}]
    assert user_turns(messages, "all") == [messages[:2], messages[2:3]]
    assert user_turns(CONVERSATIONS[0]["messages"], "first") == [CONVERSATIONS[0]["messages"][:1]]
    with pytest.raises(ValueError, match="no user turn"):
        user_turns([{"role": "system", "content": "y"}], "all")


def answer_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for position, bit in enumerate(mask + [0]):
        if bit and start is None:
            start = position
        elif not bit and start is not None:
            spans.append((start, position))
            start = None
    return spans


def test_loss_mask_of_first_turns_is_exactly_what_follows_the_rendered_prompt(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVERSATIONS)
    generate(GenerateConfig(prompts=str(prompts), out=str(tmp_path / "store"), target="debug", max_new_tokens=6,
                            concurrency=2, layers="last"), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(resolve("debug"))
    by_id = {c["id"]: c for c in CONVERSATIONS}
    store = Store(tmp_path / "store")
    assert sorted(store.table["id"]) == sorted(by_id)
    for row in store.table:
        conversation = by_id[row["id"]]
        first = user_turns(messages_of(conversation), "first")[0]
        prompt = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert row["input_ids"][:len(prompt_ids)] == prompt_ids
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * (row["length"] - len(prompt_ids))
        assert 1 <= row["length"] - len(prompt_ids) <= 6


@pytest.mark.slow
def test_loss_mask_of_all_turns_is_exactly_the_answers_in_the_chat_templates_rendering(tmp_path):
    """On the default target, whose answers are text that tokenizes back to the same ids."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVERSATIONS)
    generate(GenerateConfig(prompts=str(prompts), out=str(tmp_path / "store"), target=DEFAULT_TARGET, turns="all",
                            max_new_tokens=10, concurrency=3, layers="last"), progress=False)
    store = Store(tmp_path / "store")
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_id = {c["id"]: c for c in CONVERSATIONS}
    num_checked = 0
    for row in store.table:
        ids, mask = row["input_ids"], row["loss_mask"]
        spans = answer_spans(mask)
        turn_messages = user_turns(messages_of(by_id[row["id"]]), "all")
        assert len(spans) == len(turn_messages)
        answers = [ids[start:end] for start, end in spans]
        texts = [tokenizer.decode([t for t in answer if t != eos]) for answer in answers]
        if any(tokenizer.encode(text, add_special_tokens=False) != [t for t in a if t != eos] for text, a in zip(texts, answers)):
            continue  # this answer's text does not tokenize back to its ids: the template cannot reproduce them
        messages = []
        for leading, text in zip(turn_messages, texts):
            messages += leading + [{"role": "assistant", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        encoding = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        expected_ids = encoding["input_ids"]
        # The store ends where the last answer ends; the template goes on to close it.
        assert ids == expected_ids[:len(ids)]
        assert tokenizer.decode(expected_ids[len(ids):]) in ("\n", "<|im_end|>\n")
        expected_mask = [0] * len(ids)
        cursor = 0
        for text, answer in zip(texts, answers):
            header = "<|im_start|>assistant\n"
            start = rendered.index(header + text, cursor) + len(header)
            end = cursor = start + len(text)
            for position, (first, last) in enumerate(encoding["offset_mapping"][:len(ids)]):
                if start <= first and last <= end and last > first:
                    expected_mask[position] = 1
            if answer[-1] == eos:  # the answer stopped on the template's own closing token
                closing = next(p for p, (first, _) in enumerate(encoding["offset_mapping"]) if first >= end)
                expected_mask[closing] = 1
        assert mask == expected_mask
        num_checked += 1
    assert num_checked >= 2


@pytest.mark.e2e  # a generate process, killed and rerun
def test_killed_run_resumes_to_the_uninterrupted_store(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"Count to {i}."} for i in range(8)])
    options = ["--target", "debug", "--prompts", str(prompts), "--max-new-tokens", "32", "--concurrency", "1",
               "--shard-size", "2", "--layers", "last"]
    assert cli(["generate", *options, "--out", str(tmp_path / "whole")]) == 0

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "training", "generate", *options, "--out", str(killed)],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (killed / rows_file(0)).exists():
        assert process.poll() is None, f"generate exited early: {process.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "no shard was committed within two minutes"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not json.loads((killed / "meta.json").read_text())["complete"]
    assert len(Store(killed)) < 8, "the run finished before it was killed"

    assert cli(["generate", *options, "--out", str(killed)]) == 0
    whole, resumed = Store(tmp_path / "whole"), Store(killed)
    assert sorted(resumed.table["id"]) == sorted(whole.table["id"]) == sorted(f"p{i}" for i in range(8))
    by_id = {item["id"]: item for item in whole}
    for item in resumed:
        expected = by_id[item["id"]]
        assert item["input_ids"].tolist() == expected["input_ids"].tolist()
        assert item["loss_mask"].tolist() == expected["loss_mask"].tolist()
        torch.testing.assert_close(item["hidden"]["last"], expected["hidden"]["last"])


def test_rerun_with_other_settings_fails_before_generating(debug_store):
    path, _ = debug_store
    config = GenerateConfig(prompts=str(path.parent / "prompts.jsonl"), out=str(path), target="debug", turns="all",
                            max_new_tokens=12, temperature=0.7)
    with pytest.raises(ValueError, match=r"other settings.*sampling\.temperature: 0\.0 vs 0\.7"):
        generate(config, progress=False)


def test_config_file_is_the_default_and_flags_override_it(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVERSATIONS)
    out = tmp_path / "store"
    assert cli(["generate", "--config", str(ROOT / "configs" / "generate.yaml"), "--target", "debug",
                "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "3", "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    config = GenerateConfig.from_options({"config": str(ROOT / "configs" / "generate.yaml")})
    assert meta["sampling"]["temperature"] == config.temperature and meta["sampling"]["max_new_tokens"] == 3
    assert meta["layers"] == list(config.layers) and meta["counts"]["num_examples"] == 2 and meta["complete"]


def test_bad_options_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="no prompts given: pass --prompts"):
        GenerateConfig.from_options({"out": "x"})
    (tmp_path / "bad.yaml").write_text("prompts: sharegpt\nmax_new_token: 3\n")
    with pytest.raises(ValueError, match="unknown keys max_new_token"):
        GenerateConfig.from_options({"config": str(tmp_path / "bad.yaml")})
    with pytest.raises(ValueError, match="choose some of last, eagle3"):
        GenerateConfig(prompts="p", out="o", layers="last,medusa")
    with pytest.raises(ValueError, match="exactly three"):
        GenerateConfig(prompts="p", out="o", aux_layers="1,2")
    with pytest.raises(ValueError, match="pass --aux-layers"):
        generate(GenerateConfig(prompts="p", out=str(tmp_path / "o"), target="debug", aux_layers="1,2,9"))
    with pytest.raises(ValueError, match="num_prompts=0 is invalid: it must be >= 1, or null for all"):
        GenerateConfig(prompts="p", out="o", num_prompts=0)
    with pytest.raises(ValueError, match="device='tpu' is not a device: use auto, cpu, cuda or cuda:N"):
        GenerateConfig(prompts="p", out="o", device="tpu")


def test_a_run_whose_every_prompt_is_too_long_says_so_and_a_corrected_rerun_into_the_same_folder_proceeds(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", CONVERSATIONS)
    out = tmp_path / "store"
    with pytest.raises(ValueError, match=rf"every prompt \(3\) is longer than max_model_len=8 tokens, so {out} holds "
                                         "no example: rerun with a larger --max-model-len"):
        generate(GenerateConfig(prompts=str(prompts), out=str(out), target="debug", max_model_len=8), progress=False)
    assert cli(["generate", "--prompts", str(prompts), "--out", str(out), "--target", "debug",
                "--max-model-len", "64", "--max-new-tokens", "2"]) == 0  # long enough for these prompts
    assert Store(out).meta["prompts"]["max_model_len"] == 64 and len(Store(out)) == 3
    # a store that holds examples still refuses other settings
    with pytest.raises(ValueError, match="holds a store written with other settings"):
        generate(GenerateConfig(prompts=str(prompts), out=str(out), target="debug", max_model_len=32), progress=False)
