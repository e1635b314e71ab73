"""Every fit config in configs/ runs: one fast step (fast_dev_run) through `draftheads fit` on the debug target and
a small debug store, writing the engine's head folder; `draftheads validate` runs on what fit checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import heads
from training.cli import main

pytestmark = pytest.mark.usefixtures("in_tmp_path")

ROOT = Path(__file__).resolve().parents[2]
FIT_CONFIGS = sorted(path for path in (ROOT / "configs").glob("*.yaml") if "model" in yaml.safe_load(path.read_text()))


def test_there_is_a_config_per_head_kind():
    assert {path.stem for path in FIT_CONFIGS} == {"medusa", "eagle", "eagle3", "mtp", "peagle", "dflash"}


@pytest.mark.parametrize("config", FIT_CONFIGS, ids=lambda path: path.stem)
def test_config_runs_one_fast_step(config, debug_store):
    kind = config.stem
    overrides = ["--model.init_args.target=debug", f"--data.store={debug_store}", "--trainer.enable_progress_bar=false",
                 "--trainer.enable_model_summary=false"]
    assert main(["fit", "-c", str(config), "--trainer.fast_dev_run=true", *overrides]) == 0
    head = heads.load(Path("runs") / kind / "heads" / "last")
    assert head.config.kind == kind and head.config.metadata["training"]["global_step"] == 1


def test_validate_runs_on_a_fit_checkpoint(debug_store):
    config = str(ROOT / "configs" / "medusa.yaml")
    overrides = ["--model.init_args.target=debug", f"--data.store={debug_store}", "--trainer.logger=false",
                 "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    assert main(["fit", "-c", config, "--trainer.max_steps=1", *overrides]) == 0
    assert main(["validate", "-c", config, "--ckpt_path=runs/medusa/checkpoints/last.ckpt", *overrides]) == 0


@pytest.mark.parametrize("name", ["medusa", "eagle", "eagle3", "mtp", "peagle", "dflash", "data", "export_heads"])
def test_help_explains_every_setting(name):
    """`draftheads fit --model.help CLASS` (and --data.help, --trainer.callbacks.help) describe every setting, from
    the classes' docstrings."""
    from jsonargparse import ArgumentParser

    from training.callbacks import ExportHeads
    from training.data.datamodule import DraftDataModule
    from training.modules import MODULES

    cls = {"data": DraftDataModule, "export_heads": ExportHeads}.get(name) or MODULES[name]
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "x")
    settings = {action.dest: action.help for action in parser._actions if action.dest.startswith("x.")}
    assert settings and not [dest for dest, text in settings.items() if not text]
