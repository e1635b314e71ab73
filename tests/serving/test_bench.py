"""`draftheads bench` from the command line: a run writes its table and JSON with every method's outputs identical
to plain decoding; options that cannot run are refused before the target loads, naming the option."""
from __future__ import annotations

import json

import pytest

from training.cli import main as cli


def test_a_bench_writes_every_method_identical_to_plain(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli(["bench", "--target", "debug", "--num-prompts", "2", "--max-new-tokens", "6", "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 3}', "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["method"] for row in result["rows"]] == ["plain", "ngram"]
    assert all(row["identical_to_plain"] for row in result["rows"]) and result["num_prompts"] == 2
    captured = capsys.readouterr()
    assert "| ngram |" in captured.out
    assert "plain + 1 drafters: 100%" in captured.err and "2/2" in captured.err  # the progress bar over the prompts


@pytest.mark.parametrize("option", ["--num-prompts", "--max-new-tokens", "--concurrency"])
def test_options_below_one_are_refused_by_name(option, capsys):
    assert cli(["bench", "--target", "debug", option, "0"]) == 2
    assert f"draftheads bench: error: {option}=0 must be >= 1" in capsys.readouterr().err


def test_an_empty_prompt_file_is_refused(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert cli(["bench", "--target", "debug", "--prompts", str(tmp_path / "empty.jsonl")]) == 2
    assert f"{tmp_path / 'empty.jsonl'} holds no prompts: write one JSON object per line" in capsys.readouterr().err


def test_a_missing_head_is_refused_before_any_method_runs(tmp_path, capsys):
    assert cli(["bench", "--target", "debug", "--num-prompts", "2", "--max-new-tokens", "6",
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                "--speculative-config", f'{{"method": "eagle", "model": "{tmp_path / "nope"}"}}']) == 2
    err = capsys.readouterr().err
    assert f"no head checkpoint at {tmp_path / 'nope'}" in err
    assert "drafters:" not in err  # the timed loop and its progress bar never started
