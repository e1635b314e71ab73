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
    assert {path.stem for path in FIT_CONFIGS} == {"medusa", "eagle", "eagle3", "mtp", "peagle", "dflash", "dspark"}


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


@pytest.mark.parametrize("name", ["medusa", "eagle", "eagle3", "mtp", "peagle", "dflash", "dspark", "data",
                                  "export_heads"])
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


DEMO_FIT_CONFIGS = sorted(path for path in (ROOT / "configs" / "demo").glob("*.yaml")
                          if "model" in yaml.safe_load(path.read_text()))


def test_the_demo_has_a_recipe_per_kind_it_trains():
    from training import demo

    assert {path.stem for path in DEMO_FIT_CONFIGS} == set(demo.KINDS)


@pytest.mark.parametrize("overlay", DEMO_FIT_CONFIGS, ids=lambda path: path.stem)
def test_demo_recipe_runs_over_its_base_config(overlay, debug_store):
    """`draftheads fit -c configs/KIND.yaml -c configs/demo/KIND.yaml`, as the demo and README run it: the overlay's
    settings reach the head (the token map it names, its batch size), the base config's the rest."""
    from training import demo
    from training.data.store import Store

    kind, settings = overlay.stem, yaml.safe_load(overlay.read_text())
    takes_map = "token_map" in settings["model"]["init_args"]
    if takes_map:  # the file the overlay names, written as the demo writes it
        from training.data.vocab import frequent_tokens, write_token_map

        write_token_map(frequent_tokens(Store(debug_store), demo.DRAFT_VOCAB_SIZE), settings["model"]["init_args"]["token_map"])
    overrides = ["--model.init_args.target=debug", f"--data.store={debug_store}", "--trainer.enable_progress_bar=false",
                 "--trainer.enable_model_summary=false", "--trainer.logger=false"]
    assert main(["fit", "-c", str(ROOT / "configs" / f"{kind}.yaml"), "-c", str(overlay), "--trainer.fast_dev_run=true",
                 *overrides]) == 0
    head = heads.load(Path("runs") / kind / "heads" / "last")
    assert head.config.kind == kind
    assert (head.token_map is not None) == takes_map
    if takes_map:
        assert len(head.token_map) == demo.DRAFT_VOCAB_SIZE
    from training.fit import build_cli

    parsed = build_cli(["-c", str(ROOT / "configs" / f"{kind}.yaml"), "-c", str(overlay), *overrides], run=False).config
    assert parsed.data.batch_size == settings["data"]["batch_size"] == 2
    assert parsed.trainer.max_epochs == settings["trainer"]["max_epochs"] == demo.demo_epochs(kind)
    assert parsed.model.class_path == yaml.safe_load((ROOT / "configs" / f"{kind}.yaml").read_text())["model"]["class_path"]
    for key, value in settings["model"]["init_args"].items():
        assert parsed.model.init_args[key] == value, key


@pytest.mark.parametrize("config", ["generate.yaml", "demo/generate.yaml"])
def test_generate_config_runs(config):
    """Each store config runs, cut to a few tiny answers on the debug target (the command line overrides it)."""
    from training.data.store import Store

    args = ["generate", "-c", str(ROOT / "configs" / config), "--target", "debug", "--num-prompts", "2",
            "--max-new-tokens", "4", "--concurrency", "2", "--out", "store"]
    assert main(args) == 0
    settings = yaml.safe_load((ROOT / "configs" / config).read_text())
    meta = Store("store").meta
    assert len(Store("store")) >= 1 and meta["prompts"]["source"] == settings["prompts"]


def test_every_command_help_ends_with_an_example(capsys):
    """`draftheads COMMAND --help` ends with a runnable example of that command."""
    from training.cli import COMMANDS, EXAMPLES

    assert set(EXAMPLES) == set(COMMANDS)
    for name in COMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines[-1] == f"example: {EXAMPLES[name]}", name
        assert EXAMPLES[name].startswith(f"draftheads {name} ")


def test_demo_bench_config_lists_the_demos_rows(capsys):
    """configs/demo/bench.yaml is the MT-bench half of the demo's bench: the same configs, in the same order, as
    training/demo.py benches over the demo's heads (so `draftheads bench -c configs/demo/bench.yaml` reproduces
    the README's table)."""
    from serving.spec_decode.config import SpeculativeConfig
    from training import demo

    bench = yaml.safe_load((ROOT / "configs" / "demo" / "bench.yaml").read_text())
    listed = [SpeculativeConfig.from_json(c) for c in bench["speculative_config"]]
    demo_configs = demo.bench_configs({kind: f"runs/{kind}/heads/best" for kind in demo.DEMO_KINDS}, full=False)
    assert listed == demo_configs
    assert (bench["num_prompts"], bench["max_new_tokens"]) == (8, demo.parse_args([]).bench_new_tokens)
