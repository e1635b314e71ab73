"""Capture backends (training.data.capture): stores of the same answers written with hidden states from the engine,
from transformers and from vLLM hold the same tokens, and hidden states within bfloat16 rounding of each other
(each backend computes in float32; the store keeps bfloat16, so two backends whose float32 values straddle a
rounding boundary differ by one bfloat16 step: torch.testing's bfloat16 tolerance, rtol 1.6e-2).

`auto` takes the engine where it runs the family and transformers elsewhere: a tiny DeepSeek-V3 target, which the
engine does not run, gets a store whose hidden states equal a transformers forward's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.targets import DEFAULT_TARGET, GEMMA3_TARGET, architecture, build_tiny_model, generation_limits, resolve
from training.data.capture import resolve_capture
from training.data.generate import GenerateConfig, generate
from training.data.store import Store
from training.fit import build_cli

import heads
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


class LossLog(Callback):
    def __init__(self, losses: list[float]):
        self.losses = losses

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

CONVERSATIONS = [
    {"id": "colors", "messages": [
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, yellow and blue."}]},
    {"id": "count", "messages": [
        {"role": "user", "content": "Count to twenty."},
        {"role": "assistant", "content": " ".join(str(i) for i in range(1, 21))}]},
    {"id": "poem", "messages": [
        {"role": "system", "content": "You write short poems."},
        {"role": "user", "content": "A poem about the sea, please."},
        {"role": "assistant", "content": "Grey waves fold over the sand; the gulls lean into the wind."}]},
]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return path


def capture_store(target: Path, out: Path, capture: str, **options) -> Store:
    summary = generate(GenerateConfig(prompts=str(write_prompts(out.parent / "prompts.jsonl")), out=str(out),
                                      target=str(target), answers="dataset", max_new_tokens=32, capture=capture,
                                      aux_layers=(0, 2, 3), max_num_batched_tokens=48, **options), progress=False)
    assert summary["num_examples"] == len(CONVERSATIONS)
    return Store(out)


def assert_stores_agree(first: Store, second: Store) -> None:
    items = {item["id"]: item for item in first}
    assert len(items) == len(second) == len(CONVERSATIONS)
    for item in second:
        other = items[item["id"]]
        assert item["input_ids"].tolist() == other["input_ids"].tolist()
        assert item["loss_mask"].tolist() == other["loss_mask"].tolist()
        assert item["hidden"].keys() == other["hidden"].keys()
        for key in item["hidden"]:
            torch.testing.assert_close(item["hidden"][key], other["hidden"][key])


FAMILIES = {"llama": {}, "mistral": dict(sliding_window=8), "qwen2": {}, "qwen3": {}, "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
            "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
            "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                            sliding_window=8)}


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_target(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, tokenizer_from=resolve(DEFAULT_TARGET),
                            **FAMILIES[request.param])


def test_engine_and_transformers_captures_agree(tiny_target, tmp_path):
    engine = capture_store(tiny_target, tmp_path / "engine", "engine")
    transformers = capture_store(tiny_target, tmp_path / "transformers", "transformers")
    assert_stores_agree(engine, transformers)
    assert engine.meta["captured_by"] == ["engine"] and transformers.meta["captured_by"] == ["transformers"]


@pytest.mark.slow
def test_engine_and_transformers_captures_agree_on_the_default_target(tmp_path):
    assert_stores_agree(capture_store(resolve(DEFAULT_TARGET), tmp_path / "engine", "engine"),
                        capture_store(resolve(DEFAULT_TARGET), tmp_path / "transformers", "transformers"))


def test_auto_captures_a_family_the_engine_does_not_run_with_transformers(tmp_path, monkeypatch):
    """DeepSeek-V3 (multi-head latent attention, routed and shared experts), which the engine leaves out: a store
    from transformers, whose hidden states equal a transformers forward's."""
    monkeypatch.setattr("training.data.teacher_forced.find_vllm_python", lambda given: None)  # as where vLLM is not
    target = build_tiny_model(tmp_path / "deepseek", "deepseek_v3", tokenizer_from=resolve(DEFAULT_TARGET),
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
                              topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4)
    store = capture_store(target, tmp_path / "store", "auto")
    assert store.meta["captured_by"] == ["transformers"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for item in store:
        with torch.no_grad():
            states = model(item["input_ids"][None], output_hidden_states=True).hidden_states  # [1, T, hidden] each
        torch.testing.assert_close(item["hidden"]["last"], states[-1][0].to(torch.bfloat16))
        eagle3 = torch.cat([states[i][0] for i in (0, 2, 3)], dim=-1)
        torch.testing.assert_close(item["hidden"]["eagle3"], eagle3.to(torch.bfloat16))


def test_auto_prefers_the_engine_then_vllm_then_transformers():
    assert resolve_capture("auto", "GptOssForCausalLM", "/venv/bin/python") == "engine"
    assert resolve_capture("auto", "DeepseekV3ForCausalLM", "/venv/bin/python") == "vllm"
    assert resolve_capture("auto", "DeepseekV3ForCausalLM", None) == "transformers"
    with pytest.raises(ValueError, match="engine does not run DeepseekV3ForCausalLM.*--capture transformers"):
        resolve_capture("engine", "DeepseekV3ForCausalLM", None)


def test_a_capture_backend_other_than_the_engine_needs_answers_from_elsewhere(tmp_path):
    with pytest.raises(ValueError, match="capture=transformers reads answers from elsewhere.*--answers dataset"):
        GenerateConfig(prompts="mt-bench", out=str(tmp_path), capture="transformers")
    with pytest.raises(ValueError, match="capture='fast' is invalid"):
        GenerateConfig(prompts="mt-bench", out=str(tmp_path), answers="dataset", capture="fast")


def trained_head(target: Path, store: Store, root: Path) -> tuple[dict, dict]:
    """An EAGLE-3 head's state dict before and after 6 seeded optimizer steps on `store`."""
    cli = build_cli(["-c", str(ROOT / "configs" / "eagle3.yaml"), f"--model.init_args.target={target}",
                     f"--data.store={store.path}", "--model.init_args.aux_layers=[0,2,3]",
                     "--model.init_args.draft_vocab_size=256", "--model.init_args.learning_rate=1e-2",
                     "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                     "--trainer.max_steps=6", "--trainer.max_epochs=-1", "--data.batch_size=2",
                     "--trainer.num_sanity_val_steps=0", "--trainer.check_val_every_n_epoch=1000",
                     f"--trainer.default_root_dir={root}"], run=False)
    start = {name: tensor.detach().clone() for name, tensor in cli.model.head.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return start, {name: tensor.detach().clone() for name, tensor in cli.model.head.state_dict().items()}


@pytest.mark.fit
def test_heads_trained_on_either_backends_store_are_interchangeable(tmp_path, in_tmp_path):
    """The same seeded fit on the engine's and on transformers' store ends at the same head, within the drift a
    bfloat16 step in a few inputs makes, far below what training moved (each tensor's change from its start): a
    fortieth at most (on a Zen 3 the qkv weights' drift measured 1/95 of their change, the other tensors' 1/4,000 and
    less)."""
    target = build_tiny_model(tmp_path / "llama", "llama", tokenizer_from=resolve(DEFAULT_TARGET))
    start, engine = trained_head(target, capture_store(target, tmp_path / "engine", "engine"), tmp_path / "fit-engine")
    _, transformers = trained_head(target, capture_store(target, tmp_path / "transformers", "transformers"),
                                   tmp_path / "fit-transformers")
    moved = [name for name in engine if engine[name].is_floating_point() and not torch.equal(engine[name], start[name])]
    assert len(moved) >= 5
    for name in moved:
        drift, trained = (engine[name] - transformers[name]).abs().max(), (engine[name] - start[name]).abs().max()
        assert drift <= trained / 40, f"{name}: the two heads differ by {drift}, training moved it by {trained}"


@pytest.mark.slow
def test_the_gemma3_target_gets_a_chat_template_and_its_stores_agree(tmp_path):
    """gemma3-270m: its pretrained GGUF gets Gemma 3's turn format and stops at <end_of_turn>; the engine's store and
    transformers' agree, and equal a transformers forward."""
    target = resolve(GEMMA3_TARGET)
    assert architecture(target) == "Gemma3ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in generation_limits(target)[0]
    store = capture_store(target, tmp_path / "store", "transformers")
    assert_stores_agree(capture_store(target, tmp_path / "engine", "engine"), store)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for item in store:
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<end_of_turn>") or sum(mask) == 32  # closed, or cut
        with torch.no_grad():
            states = model(item["input_ids"][None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(item["hidden"]["last"], states[-1][0].to(torch.bfloat16))
        torch.testing.assert_close(item["hidden"]["eagle3"],
                                   torch.cat([states[i][0] for i in (0, 2, 3)], dim=-1).to(torch.bfloat16))


@pytest.mark.fit
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_a_head_trained_on_a_new_family_s_store_drafts_in_the_engine_without_changing_its_outputs(family, tmp_path,
                                                                                                  in_tmp_path):
    """A brief EAGLE-3 fit on the engine's store of a Gemma 3 or gpt-oss target, then drafting for it in the engine:
    the loss falls, and speculative greedy outputs equal plain decoding's."""
    target = build_tiny_model(tmp_path / family, family, tokenizer_from=resolve(DEFAULT_TARGET), **FAMILIES[family])
    store = capture_store(target, tmp_path / "store", "engine")
    cli = build_cli(["-c", str(ROOT / "configs" / "eagle3.yaml"), f"--model.init_args.target={target}",
                     f"--data.store={store.path}", "--model.init_args.aux_layers=[0,2,3]",
                     "--model.init_args.draft_vocab_size=256", "--model.init_args.learning_rate=1e-2",
                     "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.max_steps=12",
                     "--trainer.max_epochs=-1", "--data.batch_size=2", "--trainer.num_sanity_val_steps=0",
                     "--trainer.check_val_every_n_epoch=1000", f"--trainer.default_root_dir={tmp_path}"], run=False)
    losses = []
    cli.trainer.callbacks.append(LossLog(losses))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert losses[-1] < losses[0]
    folder = heads.save(cli.model.head, tmp_path / "head")
    prompts = [[{"role": "user", "content": c["messages"][0]["content"]}] for c in CONVERSATIONS]
    plain = Engine(EngineConfig(str(target))).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    drafted = Engine(EngineConfig(str(target), speculative_config={"method": "eagle3", "model": str(folder),
                                                                  "num_speculative_tokens": 3}))
    outputs = drafted.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert drafted.speculator.stats.num_drafts > 0
