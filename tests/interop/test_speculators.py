"""Checkpoints written by speculators' own code (0.9, its venv `make speculators`): tiny EAGLE-3, P-EAGLE and DFlash
models built as its trainer builds them (from_training_args: its defaults, norm_before_residual true, null
target_hidden_size, no d2t/t2d over the whole vocabulary; and over a reduced draft vocabulary), saved with
save_pretrained, imported by `draftheads import`. The imported heads draft what speculators' forward drafts
(EAGLE-3's training-time test, P-EAGLE's depth 0), and DFlash's read each tensor where it belongs."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import speculators_process
from serving.targets import build_tiny_model
from training.import_head import import_head
from training.modules.unroll import UnrolledAttention, shift_left

NUM_POSITIONS, STEPS = 12, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Eight layers: speculators' default aux layers (2, L // 2, L - 3) are distinct only from L = 6."""
    return build_tiny_model(tmp_path_factory.mktemp("target8"), "llama", num_hidden_layers=8)


def built(kind, target, folder, reduced: bool, *flags, **options):
    args = ["build", kind, target, folder, *(f"--{flag.replace('_', '-')}" for flag in flags)]
    if reduced:
        torch.save(torch.arange(3, 256, 3), folder.parent / f"{folder.name}-ids.pt")
        args += ["--draft-ids", folder.parent / f"{folder.name}-ids.pt"]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value]
    speculators_process.run(*args)
    return folder


def their_drafts(kind, folder, hidden_states, input_ids, steps, tmp_path):
    """speculators' forward: draft ids [steps, S], step s at position t drafting x_{t+s+2}. It reads input_ids[t] as
    x_{t+1} (its data pipeline shifts them) and feeds x_{t+s+1} at step s."""
    torch.save({"hidden_states": hidden_states, "input_ids": shift_left(input_ids, 1), "steps": steps},
               tmp_path / "inputs.pt")
    speculators_process.run("drafts", kind, folder, tmp_path / "inputs.pt", tmp_path / "drafts.pt")
    return torch.load(tmp_path / "drafts.pt")


def our_drafts(head, hidden_states, input_ids, steps):
    """The imported head's training-time test over the same inputs: draft ids [steps, S]."""
    attention = UnrolledAttention(torch.ones_like(input_ids, dtype=torch.bool))
    features, positions, drafts = head.fuse(hidden_states), torch.arange(input_ids.shape[1])[None], []
    with torch.no_grad():
        for s in range(steps):
            features = head(shift_left(input_ids, s + 1), features, positions + s, attention)
            drafts.append(head.logits(features).argmax(-1))
    return torch.cat(drafts)


def inputs(head, seed: int):
    generator = torch.Generator().manual_seed(seed)
    num_aux = len(head.config.aux_layers)
    return (torch.randn(1, NUM_POSITIONS, num_aux * head.config.hidden_size, generator=generator),
            torch.randint(0, head.config.vocab_size, (1, NUM_POSITIONS), generator=generator))


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocabulary", "draft-vocabulary"])
def test_speculators_checkpoints_import_and_draft_as_its_forward(kind, reduced, target, speculators_python, tmp_path):
    folder = built(kind, target, tmp_path / kind, reduced)
    config = json.loads((folder / "config.json").read_text())
    assert config["norm_before_residual"] is True and config["target_hidden_size"] is None
    assert ("d2t" in load_file(str(folder / "model.safetensors"))) == reduced
    assert config["embed_requires_grad"] is (kind == "peagle")  # its defaults
    head, layout = import_head(folder, kind, target)
    assert layout.source == "speculators" and head.config.norm_before_residual
    assert not head.config.own_embedding  # trainable, but untrained: still the verifier's
    assert head.config.draft_vocab_size == (85 if reduced else 256)
    assert head.config.aux_layers == (2, 4, 5)
    steps = STEPS if kind == "eagle3" else 1  # P-EAGLE's depth 0 is EAGLE-3's first step
    hidden_states, input_ids = inputs(head, seed=1)
    theirs = their_drafts(kind, folder, hidden_states, input_ids, steps, tmp_path)
    ours = our_drafts(head, hidden_states, input_ids, steps)
    assert theirs.shape == ours.shape == (steps, NUM_POSITIONS)
    assert torch.equal(ours, theirs)
    if reduced:
        assert torch.equal(head.to_target_ids(ours), ours + head.d2t[ours]) and (head.to_target_ids(ours) % 3 == 0).all()


@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocabulary", "draft-vocabulary"])
def test_speculators_dflash_checkpoints_import_with_each_tensor_where_it_belongs(reduced, target, speculators_python,
                                                                               tmp_path):
    """speculators' DFlash (two Qwen3 layers, blocks of 4): its file's layers, fc and norms are the imported head's;
    its draft vocabulary (the verifier's LM head rows of d2t's ids) becomes the head's token map."""
    folder = built("dflash", target, tmp_path / "dflash", reduced, block_size=4)
    theirs = load_file(str(folder / "model.safetensors"))
    head, _ = import_head(folder, "dflash", target)
    c = head.config
    assert (c.num_layers, c.block_size, c.causal) == (2, 4, False)
    assert c.target_layers == tuple(json.loads((folder / "config.json").read_text())["aux_hidden_state_layer_ids"])
    assert torch.equal(head.fc.weight, theirs["fc.weight"]) and torch.equal(head.norm.weight, theirs["norm.weight"])
    assert torch.equal(head.layers[1].down.weight, theirs["layers.1.mlp.down_proj.weight"])
    assert torch.equal(head.layers[0].qkv.weight, torch.cat([theirs[f"layers.0.self_attn.{p}_proj.weight"]
                                                            for p in "qkv"]))
    if reduced:
        assert torch.equal(head.token_map, torch.arange(3, 256, 3))
        torch.testing.assert_close(head.target.lm_head.weight, theirs["lm_head.weight"])
    else:
        assert head.token_map is None


@pytest.mark.parametrize("kind, flags", [("peagle", ()), ("eagle3", ("embed_requires_grad",))],
                         ids=["peagle-defaults", "eagle3-embed-requires-grad"])
def test_a_trained_embedding_imports_as_the_heads_own_and_drafts_as_its_forward(kind, flags, target,
                                                                               speculators_python, tmp_path):
    """speculators' P-EAGLE trains its embedding by default (embed_requires_grad), its EAGLE-3 when asked: the
    file's embedding, moved away from the verifier's as training moves it, is the imported head's own, and the head
    drafts what speculators' forward drafts with it."""
    folder = built(kind, target, tmp_path / kind, False, *flags, "perturb_embedding")
    assert json.loads((folder / "config.json").read_text())["embed_requires_grad"] is True
    theirs = load_file(str(folder / "model.safetensors"))
    head, _ = import_head(folder, kind, target)
    assert head.config.own_embedding
    assert torch.equal(head.embed_tokens.weight, theirs["embed_tokens.weight"])
    assert not torch.equal(head.embed_tokens.weight, head.target.embed.weight)
    steps = STEPS if kind == "eagle3" else 1
    hidden_states, input_ids = inputs(head, seed=2)
    ours = our_drafts(head, hidden_states, input_ids, steps)
    assert torch.equal(ours, their_drafts(kind, folder, hidden_states, input_ids, steps, tmp_path))
    with torch.no_grad():  # the embedding decides drafts here: the target's would draft otherwise
        head.embed_tokens.weight.copy_(head.target.embed.weight)
    assert not torch.equal(our_drafts(head, hidden_states, input_ids, steps), ours)
