"""benchmarks/recipes.py: our recipe against each published one, end to end on a tiny debug store (every fit, the
calibration that equalises fit cost, the bench, the table), and the option the EAGLE-1 recipe needed (noise_length)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from training.data.store import Store
from training.data.vocab import frequent_tokens, write_token_map
from training.modules import MODULES

ROOT = Path(__file__).resolve().parents[2]
# benchmarks/ is a folder of scripts (python -m benchmarks.recipes from the repository root), not an installed package
_spec = importlib.util.spec_from_file_location("benchmarks_recipes", ROOT / "benchmarks" / "recipes.py")
recipes = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(recipes)


def test_recipes_fit_each_kind_both_ways_and_write_one_row_per_kind_and_recipe(debug_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    token_map = tmp_path / "token_map.pt"
    write_token_map(frequent_tokens(Store(debug_store), 64), token_map)
    out = tmp_path / "out"
    argv = ["--store", str(debug_store), "--token-map", str(token_map), "--target", "debug", "--out", str(out),
            "--epochs", "1", "--calibration-warmup", "1", "--calibration-steps", "1", "--calibration-rounds", "1",
            "--bench-prompts", "1", "--bench-new-tokens", "2", "--nice", "0"]
    report = recipes.main(argv)

    expected = [("medusa", "ours"), ("medusa", "published"), ("eagle", "ours"), ("eagle", "published"),
                ("eagle3", "ours"), ("eagle3", "published"), ("mtp", "ours")]
    assert [(row["kind"], row["recipe"]) for row in report["rows"]] == expected
    assert json.loads((out / "recipes.json").read_text())["rows"] == report["rows"]
    table = (out / "recipes.md").read_text().splitlines()
    assert "val/tau_walk" in table[0] and "MT-bench tau" in table[0]
    assert [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in table[2:]] == expected
    for row in report["rows"]:
        assert row["mt_bench_tau"] >= 1.0 and 1.0 <= row["val/tau_walk"] <= 1 + recipes.head_fits.NUM_DRAFTS
        assert 0.0 <= row["val/acc_1"] <= 1.0
    # The published recipes' settings reach the modules: a head's config keeps the hyperparameters it was fit with.
    for kind, recipe in recipes.PUBLISHED.items():
        [row] = [r for r in report["rows"] if (r["kind"], r["recipe"]) == (kind, "published")]
        hparams = json.loads((out / f"{kind}-published" / "runs" / kind / "heads" / "best" / "config.json").read_text())[
            "metadata"]["training"]["hparams"]
        assert {key: hparams[key] for key in recipe.model} == recipe.model
        assert row["scaling"] in ("equal epochs", "steps x cost") and row["num_steps"] >= 1
    # A rerun with the same arguments reuses every fit.
    again = recipes.main(argv)
    assert [row["seconds"] for row in again["rows"]] == [row["seconds"] for row in report["rows"]]


def test_eagle_noise_length_scales_the_noise_by_length_as_eagle_s_code_does(monkeypatch):
    """noise_length N: U(-a, a) with a = noise * N / T for an example of T tokens (EAGLE's (U - 0.5) * 0.2 * 512 / T)."""
    module = MODULES["eagle"](target="debug", noise=0.1, noise_length=512)
    seen = {}

    def unroll(head, input_ids, features, padding_mask, num_steps, max_position, window=0):
        seen["features"] = features
        return [features]

    monkeypatch.setattr("training.modules.eagle.unroll", unroll)
    hidden_size = module.head.config.hidden_size
    last = torch.zeros(2, 64, hidden_size)
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[0, :16], padding[1, :64] = True, True
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "padding_mask": padding, "loss_mask": padding.clone()}
    module.training_loss(batch, {"last": last})
    amplitude = seen["features"].abs().amax(dim=(1, 2))
    bounds = torch.tensor([0.1 * 512 / 16, 0.1 * 512 / 64])
    assert torch.all(amplitude <= bounds) and torch.all(amplitude > 0.99 * bounds)
    fixed = MODULES["eagle"](target="debug", noise=0.1)
    fixed.training_loss(batch, {"last": last})
    assert seen["features"].abs().max() <= 0.1
    with pytest.raises(ValueError, match="noise_length=0"):
        MODULES["eagle"](target="debug", noise_length=0)
