"""`draftheads fit`: each head kind overfits a tiny store and, exported, drafts in the engine with tau well above 1
while the outputs stay those of plain decoding; a resumed run ends where an uninterrupted one does; a full run
logs offline to W&B and writes head folders; bad inputs fail before training.

Stores are built once per session (session_store). The debug target answers every prompt with the same token
over and over, which any head predicts; the overfit tests use a "chaotic" tiny target instead (untied, larger
init), whose greedy answers differ per prompt and never settle, so a head drafts well only once it has learned them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

import heads
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.targets import DEFAULT_TARGET, build_tiny_model, resolve
from training.data.generate import GenerateConfig, generate
from training.cli import main as cli_main
from training.fit import build_cli

pytestmark = pytest.mark.usefixtures("in_tmp_path")

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("medusa", "eagle", "eagle3", "mtp", "peagle", "dspark")


def prompt_messages(num_prompts: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short note about topic number {i}."}] for i in range(num_prompts)]


def session_target(tmp_path_factory) -> Path:
    """The chaotic tiny target, built once per session."""
    folder = tmp_path_factory.getbasetemp() / "chaotic-target"
    if not (folder / "config.json").is_file():
        build_tiny_model(folder, "llama", tokenizer_from=resolve(DEFAULT_TARGET), hidden_size=128, intermediate_size=256,
                         max_position_embeddings=8192, tie_word_embeddings=False, initializer_range=0.1)
    return folder


def session_store(tmp_path_factory, target: str, num_prompts: int = 12, max_new_tokens: int = 24,
                  layers: str = "last,eagle3") -> Path:
    """A store of `target`'s greedy answers to prompt_messages(num_prompts), built once per session."""
    folder = tmp_path_factory.getbasetemp() / f"store-{Path(target).name}-{num_prompts}-{max_new_tokens}-{layers}"
    if not (folder / "store" / "meta.json").is_file() or not json.loads((folder / "store" / "meta.json").read_text())["complete"]:
        folder.mkdir(exist_ok=True)
        prompts = folder / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": m}) + "\n"
                                   for i, m in enumerate(prompt_messages(num_prompts))))
        generate(GenerateConfig(prompts=str(prompts), out=str(folder / "store"), target=target, layers=layers,
                                max_new_tokens=max_new_tokens, concurrency=num_prompts, shard_size=8), progress=False)
    return folder / "store"


@pytest.fixture(scope="session")
def chaotic(tmp_path_factory):
    target = session_target(tmp_path_factory)
    return target, session_store(tmp_path_factory, str(target), num_prompts=8, max_new_tokens=16)


def fit_args(kind: str, target, store, *extra: str) -> list[str]:
    """LightningCLI arguments without a subcommand (build_cli(..., run=False)) for configs/<kind>.yaml."""
    return ["-c", str(ROOT / "configs" / f"{kind}.yaml"), f"--model.init_args.target={target}",
            f"--data.store={store}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", *extra]


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


# Per kind: (overrides, optimizer steps, factor the training loss must fall by). EAGLE-1 and EAGLE-3 log the KL
# to the target's distribution, which a perfect fit takes to 0; Medusa and MTP the cross-entropy to its tokens.
# Heads with decoder layers get twice the target's MLP width, which the exported head must keep.
WIDE = "--model.init_args.intermediate_size=512"
OVERFIT = {
    "medusa": (["--model.init_args.learning_rate=1e-2"], 24, 3.0),
    # 60 steps: without the fc bias (the default since vLLM loads no other) the loss falls 6.7x in 40
    "eagle": (["--model.init_args.learning_rate=1e-2", "--model.init_args.noise=0", WIDE], 60, 10.0),
    "eagle3": (["--model.init_args.learning_rate=1e-2", "--model.init_args.num_steps=4",
                "--model.init_args.draft_vocab_size=512", WIDE], 40, 3.0),
    "mtp": (["--model.init_args.learning_rate=1e-2", WIDE], 30, 10.0),
    # the placeholder depths fit slower than depth 0: the mean over depths fell 2.8x in 40 steps
    "peagle": (["--model.init_args.learning_rate=1e-2", "--model.init_args.draft_vocab_size=512", WIDE], 60, 2.5),
    # the token loss and the confidence head's cross-entropy together
    "dspark": (["--model.init_args.learning_rate=1e-2", "--model.init_args.markov_rank=32", WIDE], 60, 2.5),
}
MIN_TAU = 1.6  # an untrained head drafts this chaotic target at tau ~1.0


@pytest.fixture(scope="session")
def plain_outputs(chaotic):
    target, _ = chaotic
    return [o.token_ids for o in Engine(EngineConfig(str(target), max_num_seqs=8)).generate(prompt_messages(8), SamplingParams(max_tokens=16))]


@pytest.mark.parametrize("kind", KINDS)
def test_overfits_a_tiny_store_and_drafts_in_the_engine(kind, chaotic, plain_outputs):
    target, store = chaotic
    settings, num_steps, factor = OVERFIT[kind]
    cli = build_cli(fit_args(kind, target, store, *settings, f"--trainer.max_steps={num_steps}", "--trainer.max_epochs=-1",
                             "--data.batch_size=8", "--model.init_args.warmup_steps=2",
                             "--trainer.check_val_every_n_epoch=1000", "--trainer.num_sanity_val_steps=0"), run=False)
    losses = Losses()
    cli.trainer.callbacks.append(losses)
    cli.trainer.fit(cli.model, cli.datamodule)
    first, last = sum(losses.values[:2]) / 2, sum(losses.values[-2:]) / 2
    assert last < first / factor, f"{kind} loss fell from {first:.3f} to {last:.3f}, less than {factor}x"

    folder = Path("runs") / kind / "heads" / "last"
    config = json.loads((folder / "config.json").read_text())
    assert config["metadata"]["training"]["global_step"] == num_steps
    if kind != "medusa":
        assert config["intermediate_size"] == 512 != json.loads((target / "config.json").read_text())["intermediate_size"]
    engine = Engine(EngineConfig(str(target), max_num_seqs=8,
                    speculative_config={"method": kind, "model": str(folder), "num_speculative_tokens": 4}))
    drafted = engine.generate(prompt_messages(8), SamplingParams(max_tokens=16))
    assert [o.token_ids for o in drafted] == plain_outputs
    assert engine.speculator.stats.tau > MIN_TAU, f"{kind} drafts at tau {engine.speculator.stats.tau:.2f}"


class StopAt(Callback):
    """Saves a checkpoint after `step` optimizer steps and stops, as an interrupted run would have."""

    def __init__(self, step: int, path: Path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(debug_store, tmp_path):
    # Batches of 3 over 11 training examples: 4 per epoch, so step 5 is in the middle of the second epoch.
    args = fit_args("eagle", "debug", debug_store, "--data.batch_size=3", "--trainer.max_steps=10", "--trainer.max_epochs=-1",
                    "--model.init_args.warmup_steps=3")

    def run(callback=None, ckpt_path=None):
        cli = build_cli(args, run=False)
        if callback is not None:
            cli.trainer.callbacks.append(callback)
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
        return cli

    whole = run()
    checkpoint = tmp_path / "interrupted.ckpt"
    interrupted = run(StopAt(5, checkpoint))
    assert interrupted.trainer.global_step == 5
    saved = torch.load(checkpoint, weights_only=False)
    assert all(key.startswith("head.") for key in saved["state_dict"]), "the frozen target must not be checkpointed"
    resumed = run(ckpt_path=checkpoint)
    assert resumed.trainer.global_step == whole.trainer.global_step == 10
    for name, tensor in whole.model.head.state_dict().items():
        torch.testing.assert_close(resumed.model.head.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert float(resumed.trainer.callback_metrics["val/tau"]) == float(whole.trainer.callback_metrics["val/tau"])


def test_a_full_run_logs_offline_and_exports_the_best_and_last_heads(debug_store, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = fit_args("medusa", "debug", debug_store, "--trainer.max_steps=4", "--data.batch_size=4",
                    "--model.init_args.warmup_steps=1")
    args.remove("--trainer.logger=false")
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert list(Path("runs/medusa/wandb").glob("offline-run-*")), "W&B must log offline by default"
    assert Path("runs/medusa/accuracy_by_position.png").is_file()
    assert Path("runs/medusa/checkpoints/last.ckpt").is_file()
    for name in ("best", "last"):
        head = heads.load(Path("runs/medusa/heads") / name, target=cli.model.target_parts)
        training = json.loads((Path("runs/medusa/heads") / name / "config.json").read_text())["metadata"]["training"]
        assert isinstance(head, heads.Medusa) and training["kind"] == "medusa" and "val/tau" in training["metrics"]
        assert head.config.target_fingerprint == cli.model.target_fingerprint
        temperatures = [training["metrics"][f"val/temperature_{i + 1}"] for i in range(cli.model.hparams.num_speculative_tokens)]
        assert head.config.confidence_temperatures == pytest.approx(temperatures)  # what the serving cut reads


def test_validating_a_checkpoint_leaves_the_exported_heads_as_the_fit_wrote_them(debug_store):
    args = fit_args("eagle", "debug", debug_store, "--trainer.max_steps=4", "--data.batch_size=4",
                    "--model.init_args.warmup_steps=1")
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)

    def head_files() -> dict[Path, bytes]:
        return {path: path.read_bytes() for name in ("best", "last") for path in sorted(Path("runs/eagle/heads", name).iterdir())}

    written = head_files()
    # A larger held-out split changes the metrics, so a validate run that exported would rewrite config.json.
    validate = build_cli([*args, "--data.heldout_fraction=0.5"], run=False)
    validate.trainer.validate(validate.model, validate.datamodule, ckpt_path="runs/eagle/checkpoints/last.ckpt")
    assert "val/tau" in validate.trainer.callback_metrics
    assert head_files() == written


def test_a_store_from_another_target_fails_before_training(debug_store, capsys):
    cli = build_cli(fit_args("eagle", DEFAULT_TARGET, debug_store, "--trainer.max_steps=1"), run=False)
    with pytest.raises(ValueError, match="generated by another target"):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 0
    # the command line says so without a traceback
    assert cli_main(["fit", *fit_args("eagle", DEFAULT_TARGET, debug_store, "--trainer.max_steps=1")]) == 2
    error = capsys.readouterr().err
    assert f"\ndraftheads fit: error: store {debug_store} was generated by another target" in "\n" + error
    assert "Traceback" not in error


def test_an_unknown_head_kind_is_named_with_the_known_ones(debug_store, tmp_path, capsys):
    config = tmp_path / "hydra.yaml"
    config.write_text((ROOT / "configs" / "eagle.yaml").read_text().replace("EagleModule", "HydraModule"))
    with pytest.raises(SystemExit):
        build_cli(["fit", "-c", str(config), "--model.init_args.target=debug", f"--data.store={debug_store}"])
    error = capsys.readouterr().err
    assert "HydraModule" in error and "training.modules.EagleModule (eagle)" in error


def test_a_misspelled_model_key_is_named_last_with_the_closest_known_one(debug_store, capsys):
    with pytest.raises(SystemExit):
        build_cli(fit_args("eagle", "debug", debug_store, "--model.init_args.learning_rat=1e-3"), run=False)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "model.init_args.learning_rat is not a setting of EagleModule: did you mean model.init_args.learning_rate?"
    with pytest.raises(SystemExit):
        build_cli(fit_args("medusa", "debug", debug_store, "--model.init_args.zzqx=1"), run=False)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("model.init_args.zzqx is not a setting of MedusaModule; it takes ") and "learning_rate" in last


def test_a_checkpoint_of_another_kind_fails_before_training(debug_store, tmp_path):
    medusa = build_cli(fit_args("medusa", "debug", debug_store, "--trainer.max_steps=1",
                                ), run=False)
    medusa.trainer.fit(medusa.model, medusa.datamodule)
    checkpoint = tmp_path / "medusa.ckpt"
    medusa.trainer.save_checkpoint(checkpoint)
    eagle = build_cli(fit_args("eagle", "debug", debug_store, "--trainer.max_steps=2"), run=False)
    with pytest.raises(ValueError, match="holds head kind medusa, but this config trains kind eagle"):
        eagle.trainer.fit(eagle.model, eagle.datamodule, ckpt_path=checkpoint)
    assert eagle.trainer.global_step == 0


def test_a_checkpoint_resumes_only_over_the_token_map_it_was_trained_over(debug_store, tmp_path):
    from training.data.store import Store
    from training.data.vocab import frequent_tokens, write_token_map

    hot = frequent_tokens(Store(debug_store), 64)
    write_token_map(hot, tmp_path / "map.pt")
    write_token_map(hot.flip(0), tmp_path / "reordered.pt")  # the same tokens, other LM-head rows
    first = build_cli(fit_args("medusa", "debug", debug_store, "--trainer.max_steps=1",
                               f"--model.init_args.token_map={tmp_path / 'map.pt'}"), run=False)
    first.trainer.fit(first.model, first.datamodule)
    checkpoint = tmp_path / "medusa.ckpt"
    first.trainer.save_checkpoint(checkpoint)
    other = build_cli(fit_args("medusa", "debug", debug_store, "--trainer.max_steps=2",
                               f"--model.init_args.token_map={tmp_path / 'reordered.pt'}"), run=False)
    with pytest.raises(ValueError, match="was trained over another token map than .*reordered.pt: resume with the "
                                         "token map file it was trained with"):
        other.trainer.fit(other.model, other.datamodule, ckpt_path=checkpoint)
    same = build_cli(fit_args("medusa", "debug", debug_store, "--trainer.max_steps=2",
                              f"--model.init_args.token_map={tmp_path / 'map.pt'}"), run=False)
    same.trainer.fit(same.model, same.datamodule, ckpt_path=checkpoint)
    assert same.trainer.global_step == 2 and torch.equal(same.model.head.token_map, hot)


def test_a_checkpoint_written_before_a_config_field_existed_resumes_at_its_default(debug_store, tmp_path):
    from training.modules.base import CHECKPOINT_KEY

    first = build_cli(fit_args("medusa", "debug", debug_store, "--trainer.max_steps=1"), run=False)
    first.trainer.fit(first.model, first.datamodule)
    checkpoint = tmp_path / "medusa.ckpt"
    first.trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)
    del saved[CHECKPOINT_KEY]["config"]["token_map_size"]  # as checkpoints of earlier versions
    torch.save(saved, checkpoint)
    resumed = build_cli(fit_args("medusa", "debug", debug_store, "--trainer.max_steps=2"), run=False)
    resumed.trainer.fit(resumed.model, resumed.datamodule, ckpt_path=checkpoint)
    assert resumed.trainer.global_step == 2


def test_a_setting_a_head_module_refuses_is_reported_as_its_own_message(debug_store, capsys):
    assert cli_main(["fit", *fit_args("medusa", "debug", debug_store, "--model.init_args.schedule=foo")]) == 2
    error = capsys.readouterr().err
    assert "draftheads fit: error: schedule='foo' is unknown: choose one of cosine, linear, constant" in error
    assert "Union subtypes" not in error  # jsonargparse's wrapping is removed
