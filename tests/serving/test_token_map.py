"""A token map (FR-Spec, SGLang's --speculative-token-map) restricts what a Medusa, EAGLE-1 or MTP head drafts.

1. A map of every token in shuffled order drafts exactly what the head drafts without one: the pruned LM head's
   rows are mapped back to the right target ids.
2. A map of half the vocabulary: every draft lies in it, and greedy outputs stay plain greedy decoding's.
3. A head trained over a map keeps it: served without one, it drafts exactly as the same weights given that map.
4. Bad maps, another map than a head's own, and maps for drafters that do not take one are clear errors.
"""
from __future__ import annotations

import pytest
import torch

import heads
from heads.token_map import lm_head_rows
from serving import targets
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig

K = 3
KINDS = ("medusa", "eagle", "mtp")
PROMPTS = [[5, 9, 13, 2, 77, 31], [100, 4, 18, 200, 3, 9, 51, 60, 7, 8, 12]]
MAX_TOKENS = 16


def new_head(kind, folder, token_map=None, **kind_fields):
    """A head with random weights (the same for a kind whatever the map); with `token_map`, trained over it."""
    parts = heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))
    if token_map is not None:
        parts.lm_head = lm_head_rows(parts.lm_head, token_map)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        head = {"medusa": lambda: heads.Medusa.from_target(parts, token_map, num_heads=K, **kind_fields),
                "eagle": lambda: heads.Eagle.from_target(parts, token_map),
                "mtp": lambda: heads.Mtp.from_target(parts, token_map, depth=2, serve_mode="chain")}[kind]()
        with torch.no_grad():  # random weights, so that drafts are not the target's own guesses
            for param in head.parameters():
                param.add_(torch.randn(param.shape) / (param.shape[-1] ** 0.5 if param.ndim >= 2 else 10))
    return head


def run(folder, head_dir, kind, token_map=None):
    spec = {"method": kind, "model": str(head_dir), "num_speculative_tokens": 2 if kind == "mtp" else K}
    if token_map is not None:
        spec["token_map"] = str(token_map)
    engine = Engine(EngineConfig(str(folder), block_size=4, num_blocks=128, max_model_len=64, speculative_config=spec))
    proposals = []
    propose = engine.speculator.drafter.propose

    def spy(ctx, requests, budgets):
        out = propose(ctx, requests, budgets)
        proposals.append({rid: list(tree.tokens) for rid, tree in out.items()})
        return out

    engine.speculator.drafter.propose = spy
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outputs], proposals, engine.speculator.stats


@pytest.mark.parametrize("kind", KINDS)
def test_token_maps_draft_among_their_tokens_only(kind, tiny_llama, tmp_path):
    head_dir = heads.save(new_head(kind, tiny_llama), tmp_path / kind)
    vocab = targets.fingerprint(tiny_llama)["vocab_size"]
    plain = [o.token_ids for o in Engine(EngineConfig(str(tiny_llama), block_size=4, num_blocks=128, max_model_len=64))
             .generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    outputs, proposals, _ = run(tiny_llama, head_dir, kind)
    assert outputs == plain and any(proposals)

    g = torch.Generator().manual_seed(0)
    torch.save(torch.randperm(vocab, generator=g), tmp_path / "all.pt")
    outputs_all, proposals_all, _ = run(tiny_llama, head_dir, kind, tmp_path / "all.pt")
    assert outputs_all == plain
    assert proposals_all == proposals

    half = torch.randperm(vocab, generator=g)[:vocab // 2]
    torch.save(half.to(torch.int32), tmp_path / "half.pt")  # any integer dtype
    outputs_half, proposals_half, stats = run(tiny_llama, head_dir, kind, tmp_path / "half.pt")
    assert outputs_half == plain
    drafted = [t for step in proposals_half for drafts in step.values() for t in drafts]
    assert drafted and set(drafted) <= set(half.tolist())
    assert sum(stats.proposed) == len(drafted)


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_trained_over_a_map_drafts_among_it_without_being_told(kind, tiny_llama, tmp_path):
    vocab = targets.fingerprint(tiny_llama)["vocab_size"]
    half = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:vocab // 2]
    torch.save(half, tmp_path / "half.pt")
    told = run(tiny_llama, heads.save(new_head(kind, tiny_llama), tmp_path / "plain"), kind, tmp_path / "half.pt")
    own = heads.save(new_head(kind, tiny_llama, half), tmp_path / "own")
    untold = run(tiny_llama, own, kind)
    assert untold[0] == told[0] and untold[1] == told[1] and any(untold[1])
    assert {t for step in untold[1] for drafts in step.values() for t in drafts} <= set(half.tolist())
    assert run(tiny_llama, own, kind, tmp_path / "half.pt")[1] == told[1]  # its own map, given again
    torch.save(half.flip(0), tmp_path / "reordered.pt")
    with pytest.raises(ValueError, match=f"drafts among the {vocab // 2} tokens of the token map it was trained over, "
                                         ".*reordered.pt is another map: drop token_map"):
        run(tiny_llama, own, kind, tmp_path / "reordered.pt")


def test_a_map_is_refused_for_medusa_heads_with_lm_heads_over_the_whole_vocabulary(tiny_llama, tmp_path):
    vocab = targets.fingerprint(tiny_llama)["vocab_size"]
    torch.save(torch.arange(vocab // 2), tmp_path / "half.pt")
    head_dir = heads.save(new_head("medusa", tiny_llama, own_lm_head=True), tmp_path / "medusa")
    with pytest.raises(ValueError, match="LM heads of its own over the whole vocabulary: a token_map applies to heads "
                                         "that read the target's LM head"):
        run(tiny_llama, head_dir, "medusa", tmp_path / "half.pt")
    own = heads.save(new_head("medusa", tiny_llama, torch.arange(vocab // 2), own_lm_head=True), tmp_path / "own")
    _, proposals, _ = run(tiny_llama, own, "medusa")
    assert any(proposals) and {t for step in proposals for d in step.values() for t in d} <= set(range(vocab // 2))


def test_bad_token_maps_are_clear_errors(tiny_llama, tmp_path):
    head_dir = heads.save(new_head("eagle", tiny_llama), tmp_path / "eagle")
    vocab = targets.fingerprint(tiny_llama)["vocab_size"]
    cases = {
        "missing.pt": (None, FileNotFoundError, "does not exist: write one with `draftheads token-map"),
        "float.pt": (torch.tensor([1.0, 2.0]), ValueError, "1-D integer tensor"),
        "matrix.pt": (torch.tensor([[1, 2]]), ValueError, "1-D integer tensor"),
        "empty.pt": (torch.tensor([], dtype=torch.int64), ValueError, "non-empty"),
        "range.pt": (torch.tensor([1, vocab]), ValueError, rf"distinct token ids in \[0, {vocab}\)"),
        "twice.pt": (torch.tensor([4, 4]), ValueError, "distinct"),
        "dict.pt": ({"ids": torch.tensor([1])}, ValueError, "1-D integer tensor"),
    }
    (tmp_path / "text.pt").write_text("not a tensor")
    with pytest.raises(ValueError, match="not a torch.save file"):
        run(tiny_llama, head_dir, "eagle", tmp_path / "text.pt")
    for name, (content, error, message) in cases.items():
        if content is not None:
            torch.save(content, tmp_path / name)
        with pytest.raises(error, match=message):
            run(tiny_llama, head_dir, "eagle", tmp_path / name)


@pytest.mark.parametrize("method", ["eagle3", "ngram", "draft_model"])
def test_token_map_is_refused_where_it_does_not_apply(method):
    with pytest.raises(ValueError, match="token_map applies to medusa, eagle, mtp, dflash, dspark heads"):
        SpeculativeConfig(method=method, model="somewhere", token_map="map.pt")
