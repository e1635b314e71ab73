"""The Lightning modules and the data module: unrolled training drafts exactly as the engine does, chain accuracy
and tau, the learning-rate schedule, the frozen target staying out of the state dict, offline and online batches
giving the same loss, and length-bucketed batches that reshuffle per epoch and resume mid-epoch."""
from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from test_fit import session_store

import heads
from heads import Eagle, Eagle3, Mtp, load_target_parts
from heads.attention import sdpa_gqa
from serving.attention import KVCache, PagedAttention, PagedMetadata
from training.data.datamodule import DraftDataModule, LengthBatches
from training.modules import MODULES, MedusaModule
from training.modules.calibration import TEMPERATURES, Calibration
from training.modules.chain_accuracy import ChainAccuracy, reached
from training.modules.schedule import lr_factor
from training.modules.unroll import unroll

SMALL = {"medusa": {"num_heads": 2, "num_speculative_tokens": 2}, "eagle": {}, "eagle3": {"num_steps": 2, "draft_vocab_size": 1024},
         "mtp": {}, "peagle": {"draft_vocab_size": 1024},
         "dflash": {"block_size": 5, "mask_token_id": 16, "num_anchors": 8},
         "dspark": {"block_size": 4, "mask_token_id": 16, "num_anchors": 8, "markov_rank": 16}}


def test_a_head_kind_is_its_speculative_method():
    """A head folder's `kind`, the module that trains it and the speculative config's `method` that serves it are one
    string (serving/drafters/head.py refuses a head whose kind is not the method)."""
    from heads.checkpoint import HEADS as HEAD_KINDS
    from serving.spec_decode.config import HEADS as HEAD_METHODS

    assert list(HEAD_KINDS) == list(MODULES) == list(HEAD_METHODS)


def feature_head(kind: str, parts, batch_size: int, num_positions: int, draft_window: int = 0):
    """(head, one drafting step as unroll calls it, features f_t [B, S, hidden]) with perturbed weights."""
    generator = torch.Generator().manual_seed(1)
    if kind == "eagle":
        head = Eagle.from_target(parts, draft_window=draft_window)
        step, features = head, torch.randn(batch_size, num_positions, parts.hidden_size, generator=generator)
    elif kind == "eagle3":
        head = Eagle3.from_target(parts, draft_window=draft_window)
        step = head
        features = head.fuse(torch.randn(batch_size, num_positions, 3 * parts.hidden_size, generator=generator))
    else:
        head = Mtp.from_target(parts, serve_mode="reuse_first", draft_window=draft_window)
        step, features = partial(head.forward_module, 0), torch.randn(batch_size, num_positions, parts.hidden_size,
                                                                        generator=generator)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return head, step, features


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_unrolled_step_s_is_the_engines_draft_s_plus_1(kind, window, tiny_llama):
    """Step s at anchor t of the unrolled training forward equals what EagleDrafter computes for draft s+1 after a
    catch-up over the real tokens up to t: the pool holds the catch-up K/V at positions <= t and each drafting step
    writes its own at t+1, t+2, ...; padded positions of a shorter sequence are never seen. With a draft window of 3
    (fewer keys than steps and anchors) the pool's layer attends within it, as the drafter's does."""
    parts = load_target_parts(tiny_llama)
    batch_size, num_positions, num_steps, block_size = 2, 12, 3, 4
    input_ids = torch.randint(3, parts.vocab_size, (batch_size, num_positions), generator=torch.Generator().manual_seed(0))
    padding_mask = torch.ones(batch_size, num_positions, dtype=torch.bool)
    padding_mask[1, 9:] = False
    head, step, features = feature_head(kind, parts, batch_size, num_positions, window)
    layer = head.config.layer_config()
    table = list(range(num_positions // block_size + 1))
    with torch.no_grad():
        outs = unroll(step, input_ids, features, padding_mask, num_steps, head.config.max_position_embeddings, window)
        for b in range(batch_size):
            length = int(padding_mask[b].sum())
            for t in range(length - 1):
                cache = KVCache(1, len(table), block_size, layer.num_kv_heads, layer.head_dim, torch.float32, "cpu",
                                windows=(window,))
                meta = PagedMetadata.build([t + 1], [t + 1], [table], block_size, "cpu")
                drafted = step(input_ids[b, 1:t + 2], features[b, :t + 1], torch.arange(t + 1), PagedAttention(cache, meta))[-1:]
                torch.testing.assert_close(drafted[0], outs[0][b, t], atol=1e-5, rtol=1e-5)
                for s in range(1, min(num_steps, length - 1 - t)):
                    meta = PagedMetadata.build([1], [t + s + 1], [table], block_size, "cpu")
                    drafted = step(input_ids[b, t + s + 1:t + s + 2], drafted, torch.tensor([t + s]), PagedAttention(cache, meta))
                    torch.testing.assert_close(drafted[0], outs[s][b, t], atol=1e-5, rtol=1e-5, msg=f"step {s}, anchor {t}")


class ExplicitWindowSteps:
    """The reference for a windowed draft layer: one sequence, keys appended call by call with their positions, each
    query row attending to the keys at positions p with q - window < p <= q, its mask written out entry by entry."""

    def __init__(self, window: int):
        self.window, self.k, self.v, self.key_positions = window, [], [], []
        self.query_positions: list[int] = []

    def __call__(self, layer_idx, q, k, v):  # q, k, v: [1, rows, heads, head_dim]
        self.k.append(k)
        self.v.append(v)
        self.key_positions += self.query_positions
        mask = torch.tensor([[q_pos - self.window < k_pos <= q_pos for k_pos in self.key_positions]
                             for q_pos in self.query_positions])
        return sdpa_gqa(q, torch.cat(self.k, dim=1), torch.cat(self.v, dim=1), mask[None])


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_unrolled_steps_with_a_draft_window_equal_dense_attention_under_an_explicit_window_mask(kind, tiny_llama):
    """Every step of the windowed unroll (window 3, 4 steps) against the layer run on one sequence at a time with
    dense attention under a mask written out position by position: the context's rows at positions <= t, then the
    drafting steps at t+1, t+2, ..., each row seeing only the keys of its window."""
    parts = load_target_parts(tiny_llama)
    window, num_positions, num_steps = 3, 10, 4
    input_ids = torch.randint(3, parts.vocab_size, (1, num_positions), generator=torch.Generator().manual_seed(2))
    head, step, features = feature_head(kind, parts, 1, num_positions, window)
    with torch.no_grad():
        outs = unroll(step, input_ids, features, torch.ones(1, num_positions, dtype=torch.bool), num_steps,
                      head.config.max_position_embeddings, window)
        for t in range(num_positions - num_steps):
            attention = ExplicitWindowSteps(window)
            attention.query_positions = list(range(t + 1))
            out = step(input_ids[:, 1:t + 2], features[:, :t + 1], torch.arange(t + 1)[None], attention)[:, -1:]
            torch.testing.assert_close(out[0, 0], outs[0][0, t], atol=1e-5, rtol=1e-5)
            for s in range(1, num_steps):
                attention.query_positions = [t + s]
                out = step(input_ids[:, t + s + 1:t + s + 2], out, torch.tensor([[t + s]]), attention)
                torch.testing.assert_close(out[0, 0], outs[s][0, t], atol=1e-5, rtol=1e-5, msg=f"step {s}, anchor {t}")
        unwindowed = unroll(step, input_ids, features, torch.ones(1, num_positions, dtype=torch.bool), num_steps,
                            head.config.max_position_embeddings)
    assert not torch.allclose(unwindowed[-1], outs[-1], atol=1e-3), "the window changed nothing"


def test_chain_accuracy_is_conditional_on_earlier_drafts_and_gives_tau():
    metric = ChainAccuracy(3)
    correct = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    metric.update(correct, valid)
    result = metric.compute()
    # Position 1: 3 of 4 right. Position 2: reached by 3, right in 2. Position 3: reached by 2 (the last anchor has
    # no label there), right in 1.
    torch.testing.assert_close(result["accuracy"], torch.tensor([3 / 4, 2 / 3, 1 / 2]))
    assert math.isclose(float(result["tau"]), 1 + 3 / 4 + 3 / 4 * 2 / 3 + 3 / 4 * 2 / 3 * 1 / 2, rel_tol=1e-6)


def test_tau_walk_starts_each_chain_where_the_engine_would():
    """Two examples, k=2. Example 0: anchors 0-1 are prompt, 2-7 answer. At anchor 2 both drafts land (3 tokens),
    the next chain starts at anchor 5: one draft lands (2 tokens), the next at 7: its second label lies past the
    answer, so only the first can land, and it does (2 tokens). Example 1: every anchor is answer and no draft
    lands: 4 chains of 1 token. Anchors skipped over (3, 4, 6) never count, whatever their drafts."""
    metric = ChainAccuracy(2)
    correct = torch.zeros(2, 8, 2, dtype=torch.bool)
    valid = torch.zeros(2, 8, 2, dtype=torch.bool)
    valid[0, 2:, :] = True
    valid[0, 7, 1] = False
    correct[0, 2] = True
    correct[0, 3:5] = False
    correct[0, 5] = torch.tensor([True, False])
    correct[0, 6] = True
    correct[0, 7] = True
    valid[1, 4:] = True
    metric.update(correct, valid)
    result = metric.compute()
    assert math.isclose(float(result["tau_walk"]), (3 + 2 + 2 + 4) / (3 + 4), rel_tol=1e-6)
    # the per-anchor formula counts anchors 3, 4 and 6 too
    assert not math.isclose(float(result["tau"]), float(result["tau_walk"]), rel_tol=1e-3)
    metric = ChainAccuracy(3)
    metric.update(torch.ones(1, 6, 3, dtype=torch.bool), torch.ones(1, 6, 3, dtype=torch.bool))
    assert float(metric.compute()["tau_walk"]) == 4.0  # chains of k + 1 = 4 tokens from anchors 0 and 4


def test_calibration_finds_the_temperature_at_which_confidence_is_accuracy():
    """Position 0: logits twice those of a softmax whose top probability q is the chance the draft is right, so
    T = 2 is calibrated; position 1: right with probability q of the logits themselves (T = 1); position 2 never
    reached (T = 1). The grid's neighbours of 2 (1.68, 2.38) fit worse with 40,000 draws."""
    generator = torch.Generator().manual_seed(0)
    num, vocab = 40_000, 16
    q = 0.1 + 0.8 * torch.rand(num, generator=generator)
    logits = torch.log(((1 - q) / (vocab - 1))[:, None].expand(num, vocab).clone())
    logits[:, 3] = torch.log(q)
    right = torch.rand(num, generator=generator) < q
    metric = Calibration(3)
    metric.update(0, 2 * logits[: num // 2], right[: num // 2])
    metric.update(0, 2 * logits[num // 2:], right[num // 2:])
    metric.update(1, logits, right)
    metric.update(2, logits[:0], right[:0])
    assert metric.compute() == [2.0, 1.0, 1.0]
    assert 2.0 in TEMPERATURES and 1.0 in TEMPERATURES


def test_reached_marks_drafts_whose_earlier_drafts_are_all_right():
    correct = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert reached(correct, valid).tolist() == [[True, True, True], [True, False, False], [True, True, False]]


@pytest.mark.parametrize("kind", list(MODULES))
def test_validation_calibrates_on_the_drafts_the_chain_reaches(kind, debug_store, monkeypatch):
    """Calibration sees, per position, exactly the anchors the chain metric counts as reached, with the head's
    logits there (whose argmax is right exactly where the chain metric counts a draft accepted), and the fitted
    temperatures land in the head's config, which a fit exports."""
    seen = {}
    update = Calibration.update

    def spy(self, position, logits, right):
        count, num_right = seen.get(position, (0, 0))
        seen[position] = (count + len(right), num_right + int(right.sum()))
        return update(self, position, logits, right)

    monkeypatch.setattr(Calibration, "update", spy)
    chain = {}
    compute = ChainAccuracy.compute

    def keep(self):
        chain.update(reached=self.reached.tolist(), accepted=self.accepted.tolist())
        return compute(self)

    monkeypatch.setattr(ChainAccuracy, "compute", keep)
    module = MODULES[kind](target="debug", **SMALL[kind])  # metrics wrap their methods when made
    data = DraftDataModule(str(debug_store), target="debug", batch_size=4, heldout_fraction=0.3)
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    [metrics] = trainer.validate(module, data, verbose=False)
    k = module.hparams.num_speculative_tokens
    assert [seen[i][0] for i in range(k)] == chain["reached"] and chain["reached"][0] > 0
    assert [seen[i][1] for i in range(k)] == chain["accepted"]
    temperatures = module.head.config.confidence_temperatures
    assert len(temperatures) == k and all(t in TEMPERATURES for t in temperatures)
    assert [metrics[f"val/temperature_{i + 1}"] for i in range(k)] == pytest.approx(temperatures)


def test_learning_rate_warms_up_then_decays_to_its_floor():
    cosine = partial(lr_factor, num_warmup_steps=10, num_training_steps=110, schedule="cosine", min_lr_ratio=0.1)
    linear = partial(lr_factor, num_warmup_steps=10, num_training_steps=110, schedule="linear", min_lr_ratio=0.0)
    assert [cosine(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert math.isclose(cosine(60), 0.55) and math.isclose(cosine(110), 0.1) and math.isclose(linear(60), 0.5)
    assert lr_factor(1000, 10, 110, "constant", 0.1) == 1.0


def test_the_frozen_target_follows_the_module_but_stays_out_of_its_state():
    module = MedusaModule(target="debug", num_heads=2, num_speculative_tokens=2)
    assert all(key.startswith("head.") for key in module.state_dict())
    assert not any(param is module.target_parts.embed.weight for param in module.parameters())
    module.to(torch.float64)
    assert module.target_parts.lm_head.weight.dtype == torch.float64


@pytest.mark.parametrize("kind", list(MODULES))
def test_offline_and_online_batches_give_the_same_loss(kind, debug_store):
    metrics = {}
    for mode in ("offline", "online"):
        torch.manual_seed(0)
        module = MODULES[kind](target="debug", **SMALL[kind])
        data = DraftDataModule(str(debug_store), target="debug", mode=mode, batch_size=4, heldout_fraction=0.3)
        trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        [metrics[mode]] = trainer.validate(module, data, verbose=False)
        if mode == "online":
            assert module.target_model is not None and "hidden" not in next(iter(data.val_dataloader()))
    assert math.isclose(metrics["offline"]["val/loss"], metrics["online"]["val/loss"], rel_tol=1e-4)
    assert math.isclose(metrics["offline"]["val/tau"], metrics["online"]["val/tau"], abs_tol=1e-4)
    assert math.isclose(metrics["offline"]["val/tau_walk"], metrics["online"]["val/tau_walk"], abs_tol=1e-4)


def test_online_target_is_built_on_the_device_lightning_moves_the_module_to(debug_store):
    """The target's packed layers cannot move once built for the CPU kernels, so setup builds it on the strategy's
    device (meta here, standing for a GPU) instead of the module's device before the move (the CPU)."""
    module = MedusaModule(target="debug", num_heads=2, num_speculative_tokens=2)
    data = DraftDataModule(str(debug_store), target="debug", mode="online", batch_size=4)
    module.trainer = SimpleNamespace(datamodule=data, strategy=SimpleNamespace(root_device=torch.device("meta")))
    module.setup("fit")
    assert {p.device.type for p in module.target_model.parameters()} == {"meta"}


def test_length_batches_reshuffle_per_epoch_group_lengths_and_resume_mid_epoch():
    lengths = [5, 50, 6, 51, 7, 52, 8, 53, 9, 54, 10, 55]
    batches = LengthBatches(lengths, batch_size=2, shuffle=True, seed=0, num_pool_batches=6)
    first = list(batches)
    assert sorted(i for batch in first for i in batch) == list(range(12))
    assert all(abs(lengths[a] - lengths[b]) <= 5 for a, b in first), "a pool sorted by length pairs neighbours"
    assert list(batches) == first, "the same epoch gives the same batches"
    batches.set_epoch(1)
    second = list(batches)
    assert second != first
    batches.resume(1, 2)
    assert list(batches) == second[2:]
    batches.resume(0, 2)
    assert list(batches) == second, "a saved place in another epoch is ignored"
    ranks = [list(LengthBatches(lengths, 2, True, 0, 6, num_replicas=2, rank=rank)) for rank in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == sorted(first) and not set(map(tuple, ranks[0])) & set(map(tuple, ranks[1]))


def test_lightning_reaches_the_batch_sampler_s_epoch(debug_store):
    """Lightning sets each epoch on `loader.sampler` and `loader.batch_sampler.sampler` (not on the batch sampler):
    the training loader's batches must follow it, or every epoch trains in epoch 0's order."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    data = DraftDataModule(str(debug_store), target="debug", batch_size=2, num_pool_batches=1)
    data.setup("fit")
    loader = data.train_dataloader()
    first = list(loader.batch_sampler)
    _set_sampler_epoch(loader, 1)
    assert loader.batch_sampler.epoch == 1 and list(loader.batch_sampler) != first


def test_a_store_without_the_layers_a_head_reads_fails_before_training(tmp_path_factory):
    store = session_store(tmp_path_factory, "debug", num_prompts=2, max_new_tokens=4, layers="last")
    data = DraftDataModule(str(store), target="debug", batch_size=4)
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"holds hidden states \['last'\] but this head reads \['last', 'eagle3'\]"):
        trainer.validate(MODULES["eagle3"](target="debug", **SMALL["eagle3"]), data)


@pytest.mark.parametrize("kind,own_lm_head", [("medusa", False), ("medusa", True), ("eagle", False), ("mtp", False)])
def test_a_token_map_trains_over_its_rows_and_counts_other_labels_as_misses(kind, own_lm_head, debug_store, tmp_path):
    from training.data.store import Store
    from training.data.vocab import answer_token_counts, frequent_tokens, write_token_map

    hot = frequent_tokens(Store(debug_store), 64)
    write_token_map(hot, tmp_path / "map.pt")
    extra = {"own_lm_head": True} if own_lm_head else {}
    module = MODULES[kind](target="debug", token_map=str(tmp_path / "map.pt"), **SMALL[kind], **extra)
    full = load_target_parts(module.target_folder)
    assert torch.equal(module.target_parts.lm_head.weight, full.lm_head.weight[hot])
    if own_lm_head:  # each head's own LM head starts as the map's rows of the target's
        assert all(torch.equal(lm_head.weight, full.lm_head.weight[hot]) for lm_head in module.head.lm_heads)
    assert all(key.startswith("head.") for key in module.state_dict())  # the map's lookups stay out of checkpoints
    assert torch.equal(module.head.token_map, hot) and module.head.config.token_map_size == 64
    outside = next(t for t in range(full.vocab_size) if t not in set(hot.tolist()))
    labels = torch.tensor([int(hot[5]), outside, int(hot[0])])
    rows, valid = module.draft_labels(labels, torch.tensor([True, True, False]))
    assert rows.tolist()[0] == 5 and valid.tolist() == [True, False, False]
    assert module.target_ids(torch.tensor([5, 0])).tolist() == [int(hot[5]), int(hot[0])]

    data = DraftDataModule(str(debug_store), target="debug", batch_size=4, heldout_fraction=0.3)
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      max_steps=2, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(module, data)
    assert all(torch.isfinite(p).all() for p in module.head.parameters())
    [metrics] = trainer.validate(module, data, verbose=False)
    assert math.isfinite(metrics["val/loss"]) and 1.0 <= metrics["val/tau"] <= 1 + module.hparams.num_speculative_tokens
    assert torch.equal(heads.load(heads.save(module.head, tmp_path / "head")).token_map, hot)  # the head keeps it

    # a map of tokens no answer holds: every draft is a miss, not a label left out of the metric
    counts = answer_token_counts(Store(debug_store))
    write_token_map(torch.nonzero(counts == 0).flatten()[:64], tmp_path / "absent.pt")
    absent = MODULES[kind](target="debug", token_map=str(tmp_path / "absent.pt"), **SMALL[kind], **extra)
    [metrics] = trainer.validate(absent, data, verbose=False)
    assert metrics["val/tau"] == 1.0 and metrics["val/acc_1"] == 0.0 and metrics["val/tau_walk"] == 1.0


def test_eagle3_refuses_a_token_map(tmp_path):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        MODULES["eagle3"](target="debug", token_map=str(tmp_path / "map.pt"))


def test_eagle_unrolled_training_scores_step_s_against_the_next_feature_and_token(debug_store):
    """With num_unroll_steps=3, step 0's terms are those of a one-step run, and step 1 (its input: the layer's own
    output) is scored, anchor by anchor, against h_{t+2} and x_{t+3}; later steps are weighted decay^s."""
    import torch.nn.functional as F

    one = MODULES["eagle"](target="debug", noise=0.0)
    three = MODULES["eagle"](target="debug", noise=0.0, num_unroll_steps=3)
    with torch.no_grad():
        for param in one.head.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    three.load_state_dict(one.state_dict())
    data = DraftDataModule(str(debug_store), target="debug", batch_size=4, heldout_fraction=0.3)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    loss_1, terms_1 = one.training_loss(batch, one.hidden_states(batch))
    loss_3, terms_3 = three.training_loss(batch, three.hidden_states(batch))
    for name in ("feature_loss", "token_loss", "acc_1"):
        torch.testing.assert_close(terms_3[name], terms_1[name])
    later = sum(0.8 ** s * (terms_3[f"feature_loss_{s + 1}"] + 0.1 * terms_3[f"token_loss_{s + 1}"]) for s in (1, 2))
    torch.testing.assert_close(loss_3, loss_1 + later)

    ids, mask, last = batch["input_ids"], batch["loss_mask"], three.hidden_states(batch)["last"]
    out = unroll(three.head, ids, last, batch["padding_mask"], 2, three.head.config.max_position_embeddings)[1]
    features, right, count = 0.0, 0, 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 3):
            if mask[b, t + 3]:
                features += F.smooth_l1_loss(out[b, t], last[b, t + 2]).item()
                right += int(three.head.logits(out[b, t]).argmax()) == int(ids[b, t + 3])
                count += 1
    assert count > 0
    assert math.isclose(terms_3["feature_loss_2"].item(), features / count, rel_tol=1e-4)
    assert math.isclose(terms_3["acc_2"].item(), right / count, rel_tol=1e-6)
    with pytest.raises(ValueError, match="num_unroll_steps=0"):
        MODULES["eagle"](target="debug", num_unroll_steps=0)


def greedy_before(module, last: torch.Tensor) -> torch.Tensor:
    """[B, S] the target's greedy token after each position, among the LM-head rows the head drafts from."""
    if module.kind in ("eagle3", "peagle"):
        ids = module.head.draft_token_ids
    elif module.token_map_ids is not None:
        ids = module.token_map_ids
    else:
        ids = torch.arange(module.target_parts.vocab_size)
    weight = load_target_parts(module.target_folder).lm_head.weight[ids]
    return ids[torch.einsum("bsh,vh->bsv", last.double(), weight.double()).argmax(-1)]


def prompt_loss_modules(kind: str, store, **settings):
    """Two modules with the same head, without and with prompt_loss."""
    from training.data.store import Store

    modules = []
    for prompt_loss in (False, True):
        module = MODULES[kind](target="debug", prompt_loss=prompt_loss, **SMALL[kind], **settings)
        module.use_store(Store(store))
        modules.append(module)
    with torch.no_grad():
        for param in modules[0].head.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    modules[1].load_state_dict(modules[0].state_dict())
    return modules


@pytest.mark.parametrize("kind,token_map", [("medusa", False), ("medusa", True), ("eagle", False), ("eagle3", False)])
def test_prompt_loss_labels_each_prompt_token_with_the_targets_greedy_token_there(kind, token_map, debug_store,
                                                                                  tmp_path):
    """Answer tokens label themselves; with prompt_loss a prompt token after the first is labelled by the target's
    greedy token after the tokens before it, among the rows the head drafts from, not by the prompt's own token."""
    from training.data.store import Store
    from training.data.vocab import frequent_tokens, write_token_map

    settings = {}
    if token_map:
        write_token_map(frequent_tokens(Store(debug_store), 64), tmp_path / "map.pt")
        settings["token_map"] = str(tmp_path / "map.pt")
    off, on = prompt_loss_modules(kind, debug_store, **settings)
    data = DraftDataModule(str(debug_store), target="debug", batch_size=4, heldout_fraction=0.3)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    last = on.hidden_states(batch)["last"]
    ids, answer, padding = batch["input_ids"], batch["loss_mask"], batch["padding_mask"]
    labels, has_label = off.loss_labels(batch, last)
    assert torch.equal(labels, ids) and torch.equal(has_label, answer)

    rows = on.draft_rows() if kind == "eagle3" else None
    labels, has_label = on.loss_labels(batch, last, rows, on.head.to_target_ids if kind == "eagle3" else None)
    prompt = padding & ~answer
    prompt[:, 0] = False
    assert torch.equal(has_label, answer | prompt) and prompt.any()
    assert torch.equal(labels[answer], ids[answer])
    expected = greedy_before(on, last)[:, :-1][prompt[:, 1:]]
    assert torch.equal(labels[prompt], expected)
    assert not torch.equal(expected, ids[prompt])  # the prompt's own tokens are not the target's


@pytest.mark.parametrize("kind", list(MODULES))
def test_prompt_loss_trains_on_prompt_tokens_as_on_answers_of_the_target(kind, debug_store):
    """Where every prompt token is the target's greedy token, training with prompt_loss is training on a batch whose
    every token (but the first) is an answer token; and it changes the loss of the store's own batch."""
    off, on = prompt_loss_modules(kind, debug_store)
    data = DraftDataModule(str(debug_store), target="debug", batch_size=4, heldout_fraction=0.3)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    hidden = on.hidden_states(batch)
    prompt = batch["padding_mask"] & ~batch["loss_mask"]
    prompt[:, 0] = False
    greedy = torch.zeros_like(batch["input_ids"])
    greedy[:, 1:] = greedy_before(on, hidden["last"])[:, :-1]
    as_target = {**batch, "input_ids": torch.where(prompt, greedy, batch["input_ids"])}
    all_answers = {**as_target, "loss_mask": batch["loss_mask"] | prompt}
    loss_on, terms_on = on.training_loss(as_target, hidden)
    loss_off, terms_off = off.training_loss(all_answers, hidden)
    torch.testing.assert_close(loss_on, loss_off)
    assert terms_on.keys() == terms_off.keys()
    for name in terms_on:
        torch.testing.assert_close(terms_on[name], terms_off[name])
    assert not torch.isclose(on.training_loss(batch, hidden)[0], off.training_loss(batch, hidden)[0])
