"""`draftheads check` (training/check.py): per-position acceptance trained vs served.

1. The comparison: columns within their binomial noise pass; a served column far below its reference fails, naming
   the cause by where the gap starts (position 1: the features the head reads; later: its own recurrence); the
   trained column (no counts) fails the engine only below half of it; vLLM's counters become conditional rates
   as vLLM counts them (k drafts a step: position i reached where i - 1 was accepted).
2. End to end on a tiny EAGLE-3 head fitted with validation on a tiny target's store (tests/interop/tiny_heads):
   the command prints the fit's val/acc_i and the engine's counts per position and passes. (That target's held-out
   answers are unlearnable, so its trained column is near 0 and no breakage shows against it.)
3. A learnable tiny target (a smaller init: greedy answers that fall into short cycles of tokens, which differ per
   prompt), where a fitted head has a real held-out accuracy and accepts about as often on new prompts: the healthy
   head passes, and the same head with its aux layer ids permuted in config.json falls to under half of training,
   and the check fails naming the permutation against the ids its fit recorded.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from training.check import Column, compare, vllm_column_from_counts, vllm_counts
from training.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
import tiny_heads  # noqa: E402


def test_columns_within_noise_pass_and_a_gap_names_its_cause():
    engine = Column("engine", [0.50, 0.40], [400, 200])
    close = Column("vllm", [0.47, 0.43], [400, 190])
    assert compare({"engine": engine, "vllm": close}, z=4) == []
    first = compare({"engine": engine, "vllm": Column("vllm", [0.02, 0.0], [400, 8])}, z=4)
    assert [f.position for f in first] == [1] and "aux layer order" in str(first[0])
    assert str(first[0]).startswith("position 1 accepts 0.02 in vllm vs 0.50 in engine")
    later = compare({"engine": engine, "vllm": Column("vllm", [0.50, 0.05], [400, 200])}, z=4)
    assert [f.position for f in later] == [2] and "rope" in str(later[0])


def test_the_engine_fails_against_training_only_below_half_of_it_scaled_by_position_1():
    trained = Column("trained", [0.60, 0.50])
    assert compare({"trained": trained, "engine": Column("engine", [0.35, 0.30], [300, 100])}, z=4) == []
    assert compare({"trained": trained, "engine": Column("engine", [0.90, 0.90], [300, 270])}, z=4) == []
    [finding] = compare({"trained": trained, "engine": Column("engine", [0.05, 0.2], [300, 15])}, z=4)
    assert finding.position == 1 and "aux layer ids" in str(finding)
    # position 1 at 0.40 for training's 0.60: position 2 is judged against 0.50 * 0.40 / 0.60, so 0.20 of 300
    # chains passes (below half of training's own 0.50, beyond the noise) and 0.05 does not
    assert compare({"trained": trained, "engine": Column("engine", [0.40, 0.20], [3000, 300])}, z=4) == []
    [later] = compare({"trained": trained, "engine": Column("engine", [0.40, 0.05], [3000, 300])}, z=4)
    assert later.position == 2 and "rope" in str(later)
    # too few chains to tell: a gap within 4 standard errors passes
    assert compare({"trained": trained, "engine": Column("engine", [0.0, 0.0], [3, 0])}, z=4) == []


def test_vllm_counters_become_conditional_rates():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter", 'vllm:spec_decode_num_drafts_total{model_name="target"} 10',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="0"} 8',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="1"} 4',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="target",position="2"} 1', ""])
    num_drafts, accepted = vllm_counts(text, 3)
    assert (num_drafts, accepted) == (10, [8, 4, 1])
    column = vllm_column_from_counts(num_drafts, accepted)
    assert column.reached == [10, 8, 4] and column.rates == [0.8, 0.5, 0.25]


@pytest.fixture(scope="module")
def checked_head(tmp_path_factory):
    return tiny_heads.validated("eagle3", tmp_path_factory.mktemp("check"))


def run_check(target, head, prompts, capsys) -> tuple[int, str]:
    code = main(["check", str(head), "--target", str(target), "--prompts", str(prompts), "--num-prompts", "8",
                 "--max-new-tokens", "24", "--vllm", "off"])
    return code, capsys.readouterr().out


def test_check_runs_on_a_fitted_head_and_reads_its_validation(checked_head, capsys):
    """The command end to end: the trained column is the fit's val/acc_i as the folder keeps them, the engine column
    counts chains at every position, and a head whose engine acceptance is not below training's passes."""
    target, head, prompts = checked_head
    metrics = json.loads((head / "config.json").read_text())["metadata"]["training"]["metrics"]
    code, out = run_check(target, head, prompts, capsys)
    print(out)
    assert code == 0, out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "position" not in line]
    assert len(rows) == 4
    for i, (position, trained, engine) in enumerate(rows, start=1):
        assert int(position) == i and abs(float(trained) - metrics[f"val/acc_{i}"]) < 5e-4
        assert int(engine.split("(")[1].rstrip(") ")) > 0, "every position reached by some chain"
    assert "ok: the columns agree" in out and "no vllm column: --vllm off" in out


LEARNABLE_PROMPTS, LEARNABLE_TOKENS = 64, 32


@pytest.fixture(scope="module")
def learnable_head(tmp_path_factory):
    """(target, head folder, held-out prompts): an EAGLE-3 head fitted (400 steps, a held-out quarter validated) on
    64 answers of the cycling tiny target (tiny_heads); the held-out prompts are 8 others of the same form. Measured
    here: val/acc_1 0.55, the engine 0.45 on the held-out prompts, 0.10 with the aux layer ids rotated."""
    root = tmp_path_factory.mktemp("learnable")
    target = tiny_heads.cycling_target(root / "target")
    store = tiny_heads.store(target, root / "data", LEARNABLE_PROMPTS, LEARNABLE_TOKENS, shard_size=16)
    with torch.random.fork_rng():
        head = tiny_heads.train("eagle3", target, store, root / "fit", extra=(
            "--data.heldout_fraction=0.25", "--trainer.check_val_every_n_epoch=5", "--trainer.max_steps=400"))
    heldout = tiny_heads.prompt_file(root / "heldout.jsonl", tiny_heads.prompts(LEARNABLE_PROMPTS + 8)[LEARNABLE_PROMPTS:])
    return target, head, heldout


def check_learnable(target, head, prompts, capsys) -> tuple[int, str]:
    code = main(["check", str(head), "--target", str(target), "--prompts", str(prompts), "--num-prompts", "8",
                 "--max-new-tokens", str(LEARNABLE_TOKENS), "--vllm", "off"])
    out = capsys.readouterr().out
    print(out)
    return code, out


@pytest.mark.fit
def test_check_catches_permuted_aux_layer_ids_against_training_and_passes_the_head(learnable_head, tmp_path, capsys):
    target, head, prompts = learnable_head
    trained = json.loads((head / "config.json").read_text())["metadata"]["training"]["metrics"]["val/acc_1"]
    assert trained > 0.3, "the head learned the cycles: the trained column means something"
    code, out = check_learnable(target, head, prompts, capsys)
    assert code == 0 and "ok: the columns agree" in out
    broken = shutil.copytree(head, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    assert config["aux_layers"] == [1, 2, 3]
    (broken / "config.json").write_text(json.dumps({**config, "aux_layers": [3, 1, 2]}))
    code, out = check_learnable(target, broken, prompts, capsys)
    assert code == 1
    assert "MISMATCH: position 1 accepts" in out and "in engine vs" in out
    assert ("found the head's config.json fuses aux_layers [3, 1, 2], its fit trained on [1, 2, 3]: the engine feeds "
            "fc's blocks in the config's order") in out
