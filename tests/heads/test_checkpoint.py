"""Head checkpoints: own tensors only, atomic writes, the right class back, and a clear error for every misfit."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import heads
from heads import Eagle, Eagle3, Medusa, Mtp, load, load_target_parts, save
from heads.attention import DenseCausalAttention
from heads.token_map import lm_head_rows

FINGERPRINT = {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
               "vocab_size": 256, "vocab_hash": "abc123def456", "id": "llama-4L-64d-4q2kv-256v-abc123def456"}
HEADS = {
    "medusa": lambda parts: Medusa.from_target(parts, num_heads=2, own_lm_head=True),
    "eagle": lambda parts: Eagle.from_target(parts),
    "eagle3": lambda parts: Eagle3.from_target(parts, draft_token_ids=[4, 8, 15, 16, 23, 42]),
    "mtp": lambda parts: Mtp.from_target(parts, depth=2, serve_mode="reuse_first"),
}


@pytest.fixture
def parts(tiny_llama):
    return load_target_parts(tiny_llama, fingerprint=FINGERPRINT)


def outputs(head, batch) -> list[torch.Tensor]:
    input_ids, positions, hidden = batch
    attention = DenseCausalAttention()
    if isinstance(head, Medusa):
        return [head(hidden)]
    if isinstance(head, Eagle):
        return [head.logits(head(input_ids, hidden, positions, attention))]
    if isinstance(head, Eagle3):
        logits = head.logits(head(input_ids, head.fuse([hidden] * 3), positions, attention))
        return [logits, head.to_target_ids(logits.argmax(-1))]
    return [head.logits(j, head.forward_module(j, input_ids, hidden, positions, attention)) for j in range(2)]


def perturbed(head):
    """Trained-looking weights, so a round trip that dropped or zeroed a tensor would show."""
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return head


@pytest.mark.parametrize("kind", HEADS)
def test_round_trip(kind, parts, batch, tmp_path):
    head = perturbed(HEADS[kind](parts)).eval()
    save(head, tmp_path / kind, metadata={"steps": 12, "data": "store-v1"})
    loaded = load(tmp_path / kind, FINGERPRINT, target=parts)
    assert type(loaded) is type(head)
    assert loaded.config == dataclasses.replace(head.config, metadata={"steps": 12, "data": "store-v1"})
    with torch.no_grad():
        for ours, theirs in zip(outputs(head, batch), outputs(loaded, batch), strict=True):
            assert torch.equal(ours, theirs)
    config = json.loads((tmp_path / kind / "config.json").read_text())
    assert config["kind"] == kind and config["format_version"] == heads.FORMAT_VERSION
    assert config["target_fingerprint"] == FINGERPRINT
    stored = load_file(tmp_path / kind / "model.safetensors")
    assert set(stored) == set(head.state_dict())
    target_tensors = {param.data_ptr() for param in parts.parameters()}
    assert not target_tensors & {tensor.data_ptr() for tensor in head.state_dict().values()}
    assert not any(name.startswith(("embed", "target")) for name in stored)
    assert sorted(path.name for path in tmp_path.iterdir()) == [kind]  # no temporary folders left


def test_eagle3_maps_survive_the_round_trip(parts, tmp_path):
    head = HEADS["eagle3"](parts)
    save(head, tmp_path / "e3")
    loaded = load(tmp_path / "e3")
    assert loaded.t2d.dtype == torch.bool and torch.equal(loaded.t2d, head.t2d)
    assert torch.equal(loaded.draft_token_ids, torch.tensor([4, 8, 15, 16, 23, 42]))


def test_save_replaces_a_checkpoint_and_refuses_other_folders(parts, tmp_path):
    path = tmp_path / "head"
    save(HEADS["mtp"](parts), path)
    save(HEADS["eagle"](parts), path)
    assert isinstance(load(path), Eagle)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["head"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace .*precious: it is not a head checkpoint folder"):
        save(HEADS["eagle"](parts), precious)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_load_casts_dtype(parts, tmp_path):
    save(HEADS["eagle3"](parts), tmp_path / "e3")
    loaded = load(tmp_path / "e3", dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.int64


@pytest.fixture
def saved(parts, tmp_path):
    path = tmp_path / "eagle"
    save(HEADS["eagle"](parts), path)
    return path


def rewrite_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def rewrite_tensors(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_fingerprint_mismatch_names_the_fields(saved):
    other = {**FINGERPRINT, "vocab_hash": "ffffffffffff", "id": "other"}
    with pytest.raises(ValueError, match="made for another target .*vocab_hash: head 'abc123def456', target 'ffffffffffff'"):
        load(saved, other)


def test_size_mismatches(saved, tmp_path):
    with pytest.raises(ValueError, match="hidden_size: head 64, target 32"):
        load(saved, {**FINGERPRINT, "hidden_size": 32})
    rewrite_config(saved, target_fingerprint={})
    with pytest.raises(ValueError, match="vocab_size: head 256, target 300"):
        load(saved, {"vocab_size": 300})
    from serving.targets import build_tiny_model

    small = load_target_parts(build_tiny_model(tmp_path / "small", "llama", hidden_size=32, vocab_size=128))
    with pytest.raises(ValueError, match="hidden_size: head 64, target 32; vocab_size: head 256, target 128"):
        load(saved, target=small)
    with pytest.raises(ValueError, match="made for another target: hidden_size: head 64, target 32"):
        load(saved).bind_target(small)


def test_missing_tensor(saved):
    rewrite_tensors(saved, lambda tensors: tensors.pop("fc.bias"))
    with pytest.raises(ValueError, match="missing tensor\\(s\\) \\['fc.bias'\\]"):
        load(saved)


def test_unexpected_tensor(saved):
    rewrite_tensors(saved, lambda tensors: tensors.update({"embed.weight": torch.zeros(256, 64)}))
    with pytest.raises(ValueError, match="unexpected tensor\\(s\\) \\['embed.weight'\\].*never the target's"):
        load(saved)


def test_wrong_shape(saved):
    rewrite_tensors(saved, lambda tensors: tensors.update({"fc.bias": torch.zeros(32)}))
    with pytest.raises(ValueError, match="tensor fc.bias has shape \\(32,\\), but config.json implies \\(64,\\)"):
        load(saved)


def test_unknown_kind(saved):
    rewrite_config(saved, kind="hydra")
    with pytest.raises(ValueError, match="unknown head kind 'hydra'; known kinds: medusa, eagle, eagle3, mtp"):
        load(saved)


def test_newer_format(saved):
    rewrite_config(saved, format_version=heads.FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match="format_version 2, newer than the 1 this draftheads reads: upgrade"):
        load(saved)


def test_malformed_or_missing_config(saved):
    (saved / "config.json").write_text('{"kind": "eagle", ')
    with pytest.raises(ValueError, match="config.json is malformed"):
        load(saved)
    (saved / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load(saved)
    (saved / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        load(saved)
    with pytest.raises(ValueError, match="no head checkpoint at"):
        load(saved / "nowhere")


def test_invalid_config_fields(saved):
    rewrite_config(saved, hidden_size=0)
    with pytest.raises(ValueError, match="invalid eagle config: EagleConfig.hidden_size must be a positive integer"):
        load(saved)
    rewrite_config(saved, hidden_size=64, depth=2)
    with pytest.raises(ValueError, match="unknown eagle config field\\(s\\) \\['depth'\\]"):
        load(saved)
    config = json.loads((saved / "config.json").read_text())
    del config["depth"]
    (saved / "config.json").write_text(json.dumps(config))
    for bad in ([1.0, 0], [1.0, "2"], 1.5):
        rewrite_config(saved, confidence_temperatures=bad)
        with pytest.raises(ValueError, match="confidence_temperatures=.* must be a list of positive numbers"):
            load(saved)


def test_missing_weights_file(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load(saved)


TOKEN_MAP = torch.tensor([42, 7, 200, 3, 99, 128, 15, 250])  # not sorted: row i of the logits is token TOKEN_MAP[i]
MAPPED_HEADS = {
    "medusa": lambda parts: Medusa.from_target(parts, TOKEN_MAP, num_heads=2),
    "medusa-own-lm-heads": lambda parts: Medusa.from_target(parts, TOKEN_MAP, num_heads=2, own_lm_head=True),
    "eagle": lambda parts: Eagle.from_target(parts, TOKEN_MAP),
    "mtp": lambda parts: Mtp.from_target(parts, TOKEN_MAP, depth=2, serve_mode="reuse_first"),
}


def mapped_parts(folder):
    """Target parts whose LM head holds the token map's rows, in its order."""
    parts = load_target_parts(folder, fingerprint=FINGERPRINT)
    parts.lm_head = lm_head_rows(parts.lm_head, TOKEN_MAP)
    return parts


@pytest.mark.parametrize("kind", MAPPED_HEADS)
def test_a_head_keeps_the_token_map_it_drafts_among(kind, tiny_llama, batch, tmp_path):
    parts = mapped_parts(tiny_llama)
    head = perturbed(MAPPED_HEADS[kind](parts)).eval()
    full = load_target_parts(tiny_llama, fingerprint=FINGERPRINT)
    with torch.no_grad():  # the logits are the full LM head's logits at the map's rows
        expected = full.lm_head(head.heads[0](batch[2]))[..., TOKEN_MAP] if kind == "medusa" else None
        logits = outputs(head, batch)[0]
    assert logits.shape[-1] == len(TOKEN_MAP)
    if expected is not None:
        torch.testing.assert_close(logits[0], expected)
    save(head, tmp_path / kind)
    assert json.loads((tmp_path / kind / "config.json").read_text())["token_map_size"] == len(TOKEN_MAP)
    assert torch.equal(load_file(tmp_path / kind / "model.safetensors")["token_map"], TOKEN_MAP)
    loaded = load(tmp_path / kind, FINGERPRINT, target=mapped_parts(tiny_llama))
    assert torch.equal(loaded.token_map, TOKEN_MAP)
    with torch.no_grad():
        for ours, theirs in zip(outputs(head, batch), outputs(loaded, batch), strict=True):
            assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match=f"drafts among the {len(TOKEN_MAP)} tokens of its token map, but the target "
                                         "parts' LM head has 256 rows: give it those rows"):
        load(tmp_path / kind, FINGERPRINT, target=full)


def test_a_head_without_a_map_has_none(parts, tmp_path):
    save(HEADS["eagle"](parts), tmp_path / "eagle")
    assert load(tmp_path / "eagle").token_map is None
    assert "token_map" not in load_file(tmp_path / "eagle" / "model.safetensors")


def test_bad_token_maps_are_clear_errors(tiny_llama, parts, tmp_path):
    with pytest.raises(ValueError, match=r"token_map must hold distinct token ids in \[0, 256\)"):
        Eagle.from_target(parts, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="token_map must hold a non-empty 1-D integer tensor"):
        Eagle.from_target(parts, torch.tensor([1.0, 2.0]))
    path = save(MAPPED_HEADS["eagle"](mapped_parts(tiny_llama)), tmp_path / "eagle")
    rewrite_tensors(path, lambda t: t.update(token_map=torch.tensor([42, 7, 200, 3, 99, 128, 15, 256])))
    with pytest.raises(ValueError, match=r"model.safetensors: token_map must hold distinct token ids in \[0, 256\)"):
        load(path)
    rewrite_tensors(path, lambda t: t.update(token_map=TOKEN_MAP[:4]))
    with pytest.raises(ValueError, match="token_map"):
        load(path)
    for bad in (-1, 257, True, 2.0):
        rewrite_config(path, token_map_size=bad)
        with pytest.raises(ValueError, match=r"token_map_size=.* must be an integer in \[0, vocab_size=256\]"):
            load(path)
    path = save(HEADS["eagle3"](parts), tmp_path / "eagle3")
    rewrite_config(path, token_map_size=8)
    with pytest.raises(ValueError, match="an EAGLE-3 head drafts over its own draft vocabulary"):
        load(path)
