"""`draftheads bench` from the command line: a run writes its table and JSON with every method's outputs identical
to plain decoding; options that cannot run are refused before the target loads, naming the option; a run over
several settings writes one summary, and a rerun reuses each setting's result made with the same options."""
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
    ("concurrency: [1, 0]\n", "concurrency=0 is invalid: it must be an integer >= 1"),
    ("concurrency: []\n", "concurrency=[] is invalid: give one value or several"),
    ("temperature: [0, -1]\n", "SamplingParams.temperature=-1 is invalid"),
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


def bench_args(out: Path, *more: str) -> list[str]:
    return ["bench", "--target", "debug", "--num-prompts", "2", "--max-new-tokens", "4", "--out", str(out),
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', *more]


def test_a_bench_over_several_settings_writes_one_summary_row_per_setting_and_method(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert cli(bench_args(tmp_path, "--concurrency", "1", "2", "--temperature", "0", "0.7")) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    settings = [(t, c) for t in (0.0, 0.7) for c in (1, 2)]
    assert [(r["temperature"], r["concurrency"], r["method"]) for r in rows] == [
        (t, c, method) for t, c in settings for method in ("plain", "ngram")]
    for row in rows:
        [plain] = [r for r in rows if r["method"] == "plain" and (r["temperature"], r["concurrency"]) ==
                   (row["temperature"], row["concurrency"])]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["identical_to_plain"] is (True if row["temperature"] == 0 else None)  # greedy only
        assert row["prompts"] == "mt-bench" and row["num_prompts"] == 2 and row["tau"] >= 1 and row["rows_per_step"] >= 1
    table = [line for line in (tmp_path / "summary.md").read_text().splitlines() if line.startswith("| mt-bench (2) |")]
    assert len(table) == 8 and table[3].startswith("| mt-bench (2) | 0 | 2 | ngram |") and " | yes | " in table[3]
    assert table[7].startswith("| mt-bench (2) | 0.7 | 2 | ngram |") and " | n/a | " in table[7]
    assert (tmp_path / "speedup_vs_concurrency.png").stat().st_size > 10_000
    assert len(json.loads((tmp_path / "bench.json").read_text())) == 4
    assert sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "settings").glob("*.json")) == [
        "mt-bench-T0-c1", "mt-bench-T0-c2", "mt-bench-T0.7-c1", "mt-bench-T0.7-c2"]
    [run] = (tmp_path / "wandb").glob("offline-run-*")  # the report is logged to an offline wandb run
    assert (run / "files" / "summary.json").exists() and (run / "files" / "summary.md").exists()


class Killed(Exception):
    pass


def test_a_killed_bench_reruns_only_the_settings_without_a_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    from serving.bench import sweep

    calls, run_bench = [], sweep.run_bench

    def counted(*args, **kwargs):
        calls.append(args[5])  # the concurrency
        if kill_at == len(calls):
            raise Killed
        return run_bench(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_bench", counted)
    kill_at = 2
    with pytest.raises(Killed):
        cli(bench_args(tmp_path, "--concurrency", "1", "2"))
    [kept] = (tmp_path / "settings").glob("*.json")
    assert kept.name.startswith("mt-bench-T0-c1-") and not (tmp_path / "summary.json").exists()
    capsys.readouterr()
    calls.clear()
    kill_at = None
    assert cli(bench_args(tmp_path, "--concurrency", "1", "2")) == 0
    assert calls == [2]  # the finished setting is reused, not measured again
    assert f"reusing 1 settings from {tmp_path / 'settings'}: mt-bench T=0 c=1" in capsys.readouterr().out
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [(r["concurrency"], r["method"]) for r in rows] == [(1, "plain"), (1, "ngram"), (2, "plain"), (2, "ngram")]
    kept_rows = json.loads(kept.read_text())["result"]["rows"]
    assert [r["tokens_per_s"] for r in rows[:2]] == [r["tokens_per_s"] for r in kept_rows]


def test_a_result_made_with_other_options_is_not_reused(tmp_path, capsys):
    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.bench.prompts import first_turn, load_prompts
    from serving.spec_decode.config import SpeculativeConfig
    from serving.bench.sweep import Setting, run_settings

    engine = Engine(EngineConfig("debug"))
    prompts = [first_turn(m) for m in load_prompts("mt-bench", 2)["messages"]]
    ngram = lambda k: [SpeculativeConfig(method="ngram", num_speculative_tokens=k)]
    run = lambda prompts, configs, max_new_tokens: run_settings(
        engine, {"mt-bench": (prompts, ["writing"] * len(prompts))}, [Setting("mt-bench", 0.0, 1)], configs,
        max_new_tokens, out=tmp_path)
    run(prompts, ngram(3), 4)
    [first] = (tmp_path / "settings").glob("*.json")
    for other, why in [((prompts, ngram(3), 3), "max_new_tokens 4 (now 3)"),
                       ((prompts[:1], ngram(3), 4), "num_prompts 2 (now 1), prompts_digest"),
                       ((prompts[::-1], ngram(3), 4), "prompts_digest"),
                       ((prompts, ngram(2), 4), "methods changed")]:
        capsys.readouterr()
        [result] = run(*other)
        out = capsys.readouterr().out
        assert f"not reusing {first}: made with other options: {why}" in out and "reusing 1" not in out
        assert result["max_new_tokens"] == other[2] and result["num_prompts"] == len(other[0])  # measured again
    assert len(list((tmp_path / "settings").glob("*.json"))) == 5  # all kept: each set of options reuses its own
    capsys.readouterr()
    run(prompts, ngram(3), 4)
    out = capsys.readouterr().out
    assert f"reusing 1 settings from {tmp_path / 'settings'}" in out and "not reusing" not in out


def test_a_heads_contents_are_part_of_the_options(tmp_path):
    from types import SimpleNamespace

    from serving.spec_decode.config import SpeculativeConfig
    from serving.bench.sweep import Setting, setting_options

    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "model.safetensors").write_bytes(b"weights")
    engine = SimpleNamespace(folder="debug", dtype="float32", device="cpu", block_size=16,
                             products="float32 FMA tiles over float32 weights")
    options = lambda: setting_options(engine, [[{"role": "user", "content": "hi"}]], Setting("mt-bench", 0.0, 1),
                                      [SpeculativeConfig(method="eagle", model=str(tmp_path / "head"))], 8, 0)
    before = options()
    assert before == options()
    (tmp_path / "head" / "model.safetensors").write_bytes(b"retrained")
    assert before["files"] != options()["files"] and before["methods"] == options()["methods"]
