"""`draftheads bench` from the command line: a run writes its table and JSON with every method's outputs identical
to plain decoding; options that cannot run are refused before the target loads, naming the option."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import heads
from serving import targets
from training.cli import main as cli

BENCH_YAML = Path(__file__).parents[2] / "configs" / "bench.yaml"


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
    name = option[2:].replace("-", "_")
    assert f"draftheads bench: error: {name}=0 is invalid: it must be an integer >= 1" in capsys.readouterr().err


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


def debug_heads(root: Path) -> None:
    """A new head of each kind for the debug target at root/runs/<kind>/heads/best, where configs/bench.yaml
    looks for the demo's."""
    folder = targets.resolve("debug")
    parts = heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))
    for kind, head in {"medusa": heads.Medusa.from_target(parts, num_heads=4), "eagle": heads.Eagle.from_target(parts),
                       "eagle3": heads.Eagle3.from_target(parts, draft_token_ids=list(range(0, parts.vocab_size, 2))),
                       "mtp": heads.Mtp.from_target(parts, depth=4)}.items():
        heads.save(head, root / "runs" / kind / "heads" / "best")


def test_the_bench_config_runs_every_row_it_lists(tmp_path, monkeypatch):
    debug_heads(tmp_path)
    monkeypatch.chdir(tmp_path)
    listed = yaml.safe_load(BENCH_YAML.read_text())["speculative_config"]
    assert cli(["bench", "--config", str(BENCH_YAML), "--target", "debug", "--num-prompts", "2", "--max-new-tokens", "5",
                "--json", "bench.json"]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [row["config"] and row["config"]["method"] for row in result["rows"]] == [None, *(c["method"] for c in listed)]
    assert result["num_prompts"] == 2 and result["max_new_tokens"] == 5  # the command line over the file
    assert result["hf_tokens_per_s"] > 0 and result["identical_to_hf"]  # baseline: hf, from the file
    assert all(row["identical_to_plain"] for row in result["rows"])


def test_speculative_configs_on_the_command_line_replace_the_files_list(tmp_path):
    config = tmp_path / "bench.yaml"
    config.write_text("num_prompts: 1\nmax_new_tokens: 3\nspeculative_config:\n  - {method: ngram}\n"
                      "  - {method: early_exit, num_layers: 1}\n")
    assert cli(["bench", "--config", str(config), "--target", "debug", "--json", str(tmp_path / "file.json")]) == 0
    assert cli(["bench", "--config", str(config), "--target", "debug", "--json", str(tmp_path / "line.json"),
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    rows = lambda name: [row["method"] for row in json.loads((tmp_path / name).read_text())["rows"]]
    assert rows("file.json") == ["plain", "ngram", "early_exit"]
    assert rows("line.json") == ["plain", "ngram"]


@pytest.mark.parametrize("text, message", [
    ("num_prompt: 4\n", "unknown keys num_prompt; known: target, prompts, num_prompts"),
    ("concurrency: 0\n", "concurrency=0 is invalid: it must be an integer >= 1"),
    ("temperature: -1\n", "SamplingParams.temperature=-1 is invalid"),
    ("speculative_config: {method: ngram}\n", "speculative_config={'method': 'ngram'} is invalid: give a list"),
    ("speculative_config:\n  - {method: eagle}\n", "method 'eagle' needs \"model\": a head folder"),
    ("- 1\n", "must be a YAML mapping of option names to values"),
    ("target: [\n", "is not valid YAML"),
    ("device: gpu0\n", "device='gpu0' is not a device: use auto, cpu, cuda or cuda:N"),
])
def test_a_bad_bench_config_is_refused_by_key(tmp_path, capsys, text, message):
    config = tmp_path / "bench.yaml"
    config.write_text(text)
    assert cli(["bench", "--config", str(config), "--target", "debug"]) == 2
    assert message in capsys.readouterr().err
