"""The store format on hand-made examples: round trip, memory-mapped reads, deterministic split, resume of an
interrupted writer, clear errors for broken shards and foreign targets; and the EAGLE-3 draft vocabulary."""
from __future__ import annotations

import json
import os

import pytest
import torch

from training.data.store import Store, StoreWriter, hidden_file, rows_file
from training.data.vocab import answer_token_counts, draft_vocab

HIDDEN = 8
VOCAB = 32
FINGERPRINT = {"architecture": "llama", "num_layers": 6, "hidden_size": HIDDEN, "vocab_size": VOCAB, "id": "llama-6L-8d"}


def make_meta(**overrides) -> dict:
    meta = {
        "target": {"name": "hand-made", "fingerprint": FINGERPRINT, "dtype": "float32"},
        "layers": ["last", "eagle3"],
        "aux_layers": [2, 3, 3],
        "hidden_size": HIDDEN,
        "hidden_dtype": "bfloat16",
        "sampling": {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": 0},
        "prompts": {"source": "hand-made", "turns": "first", "max_model_len": 64},
        "num_prompts": None,
    }
    meta.update(overrides)
    return meta


def make_example(index: int, length: int | None = None, hidden_size: int = HIDDEN) -> dict:
    length = length or 3 + index % 5
    generator = torch.Generator().manual_seed(index)
    return {
        "id": f"ex{index}",
        "category": "test",
        "input_ids": [(index + t) % VOCAB for t in range(length)],
        "loss_mask": [int(t >= length // 2) for t in range(length)],
        "hidden": {key: torch.randn(length, hidden_size, generator=generator) for key in ("last", "aux.2", "aux.3")},
    }


def write_store(path, examples, shard_size=2, **meta):
    writer = StoreWriter(path, make_meta(**meta), shard_size)
    for example in examples:
        writer.add(example)
    writer.close(complete=True)
    return writer


def test_round_trip_in_bf16_with_eagle3_layers_in_order(tmp_path):
    examples = [make_example(i) for i in range(5)]
    write_store(tmp_path, examples)
    store = Store(tmp_path, target_fingerprint=FINGERPRINT)
    assert len(store) == 5 and sorted(store.table["shard"]) == [0, 0, 1, 1, 2]
    by_id = {item["id"]: item for item in store}
    for example in examples:
        item = by_id[example["id"]]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == example["input_ids"]
        assert item["loss_mask"].tolist() == example["loss_mask"]
        hidden = {key: value.to(torch.bfloat16) for key, value in example["hidden"].items()}
        assert torch.equal(item["hidden"]["last"], hidden["last"])
        assert torch.equal(item["hidden"]["eagle3"], torch.cat([hidden["aux.2"], hidden["aux.3"], hidden["aux.3"]], -1))
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["complete"] and meta["counts"]["num_examples"] == 5 and meta["counts"]["num_shards"] == 3
    assert meta["counts"]["num_answer_tokens"] == sum(sum(e["loss_mask"]) for e in examples)


def test_reads_map_one_example_not_the_shard(tmp_path):
    big = make_example(0, length=16384, hidden_size=512)  # 16 MiB per key in bf16
    small = make_example(1, length=4, hidden_size=512)
    write_store(tmp_path, [big, small], hidden_size=512)
    del big
    store = Store(tmp_path)
    index = store.table["id"].index("ex1")

    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident_bytes()
    item = store[index]
    assert resident_bytes() - before < 8 * 2**20
    assert torch.equal(item["hidden"]["last"], small["hidden"]["last"].to(torch.bfloat16))


def test_split_is_deterministic_by_id_and_never_leaves_heldout_empty(tmp_path):
    write_store(tmp_path, [make_example(i, length=2) for i in range(200)], shard_size=64)
    store = Store(tmp_path)
    train, heldout = store.split()
    again_train, again_heldout = Store(tmp_path).split()
    assert train.table["id"] == again_train.table["id"] and heldout.table["id"] == again_heldout.table["id"]
    assert set(train.table["id"]) | set(heldout.table["id"]) == set(store.table["id"])
    assert not set(train.table["id"]) & set(heldout.table["id"])
    assert 2 <= len(heldout) <= 25
    assert heldout[0]["id"] == heldout.table["id"][0] and len(list(heldout)) == len(heldout)
    pair = store.select([0, 1])
    assert [len(part) for part in pair.split(0.0)] == [1, 1]
    assert [len(part) for part in store.select([0]).split()] in ([1, 0], [0, 1])


def test_resume_discards_uncommitted_files_and_redoes_shards_without_hidden_states(tmp_path):
    write_store(tmp_path, [make_example(i) for i in range(6)])
    (tmp_path / hidden_file(3)).write_bytes(b"half a shard")  # written, but its rows never were
    (tmp_path / (rows_file(4) + ".tmp")).write_bytes(b"")
    (tmp_path / hidden_file(1)).unlink()  # a user deleted a broken shard
    writer = StoreWriter(tmp_path, make_meta(), 2)
    assert writer.done_ids == {"ex0", "ex1", "ex4", "ex5"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("hidden", "rows"))) == [
        hidden_file(0), hidden_file(2), rows_file(0), rows_file(2)]
    with pytest.raises(ValueError, match="already in"):
        writer.add(make_example(0))
    writer.add(make_example(2))
    writer.add(make_example(3))
    writer.close(complete=True)
    store = Store(tmp_path)
    assert sorted(store.table["id"]) == [f"ex{i}" for i in range(6)]
    assert torch.equal(store[store.table["id"].index("ex3")]["hidden"]["last"],
                       make_example(3)["hidden"]["last"].to(torch.bfloat16))


def test_rerun_with_other_settings_names_them(tmp_path):
    write_store(tmp_path, [make_example(0)])
    other = make_meta(sampling={"max_new_tokens": 4, "temperature": 0.7, "top_p": 1.0, "seed": 0}, layers=["last"])
    with pytest.raises(ValueError, match=r"layers.*sampling\.temperature: 0\.0 vs 0\.7.*another --out"):
        StoreWriter(tmp_path, other)
    renamed = make_meta(target={"name": "/elsewhere/same-model", "fingerprint": FINGERPRINT, "dtype": "float32"})
    StoreWriter(tmp_path, renamed).close(complete=True)


def test_one_writer_at_a_time(tmp_path):
    writer = StoreWriter(tmp_path, make_meta())
    with pytest.raises(RuntimeError, match="another process is writing"):
        StoreWriter(tmp_path, make_meta())
    writer.close(complete=False)
    StoreWriter(tmp_path, make_meta()).close(complete=False)


def test_refuses_a_folder_that_holds_something_else(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no store"):
        StoreWriter(tmp_path, make_meta())


@pytest.mark.parametrize("damage", ["truncate", "header", "delete"])
def test_broken_shard_names_the_file_and_the_fix(tmp_path, damage):
    write_store(tmp_path, [make_example(i) for i in range(4)])
    file = tmp_path / hidden_file(1)
    data = file.read_bytes()
    if damage == "truncate":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        file.write_bytes(data[:8] + b"\x00garbage" + data[16:])
    else:
        file.unlink()
    with pytest.raises(ValueError, match=rf"{hidden_file(1)}.*(truncated or corrupted|missing).*delete.*rerun"):
        Store(tmp_path)


def test_store_of_another_target_names_the_differing_fields(tmp_path):
    write_store(tmp_path, [make_example(0)])
    other = {**FINGERPRINT, "num_layers": 30, "hidden_size": 576, "id": "llama-30L-576d"}
    with pytest.raises(ValueError, match=r"another target.*hidden_size: 8 vs 576.*num_layers: 6 vs 30"):
        Store(tmp_path, target_fingerprint=other)
    with pytest.raises(ValueError, match="llama-6L-8d, not llama-30L-576d"):
        Store(tmp_path, target_fingerprint="llama-30L-576d")
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        Store(tmp_path / "nowhere")


def test_draft_vocab_maps_draft_ids_to_the_most_frequent_answer_tokens(tmp_path):
    answers = [7] * 5 + [3] * 4 + [20] * 4 + [11] * 2 + [30]
    example = make_example(0, length=2 * len(answers))
    example["input_ids"] = [5] * len(answers) + answers  # token 5 is the most frequent, but only in the prompt
    example["loss_mask"] = [0] * len(answers) + [1] * len(answers)
    write_store(tmp_path, [example])
    store = Store(tmp_path)
    assert answer_token_counts(store)[[7, 3, 20, 11, 30, 5]].tolist() == [5, 4, 4, 2, 1, 0]

    d2t, t2d = draft_vocab(store, 3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    assert (torch.arange(3) + d2t).tolist() == [3, 7, 20]  # ties (3 and 20) do not matter here: both fit
    assert t2d.nonzero().flatten().tolist() == [3, 7, 20]

    d2t, t2d = draft_vocab(store, 2)
    assert (torch.arange(2) + d2t).tolist() == [3, 7]  # 3 beats 20 on a tie: the lower id

    d2t, t2d = draft_vocab(store, 8)  # five distinct answer tokens; the lowest unused ids fill the rest
    target_ids = (torch.arange(8) + d2t).tolist()
    assert target_ids == [0, 1, 2, 3, 7, 11, 20, 30]
    assert t2d.nonzero().flatten().tolist() == target_ids and int(t2d.sum()) == 8
    with pytest.raises(ValueError, match="must lie in"):
        draft_vocab(store, VOCAB + 1)


def test_token_map_command_writes_the_most_frequent_answer_tokens(tmp_path):
    from training.cli import main

    example = make_example(0, length=8)
    example["input_ids"] = [5, 5, 5, 5, 7, 7, 3, 9]
    example["loss_mask"] = [0, 0, 0, 0, 1, 1, 1, 1]
    write_store(tmp_path / "store", [example])
    out = tmp_path / "maps" / "token_map.pt"
    assert main(["token-map", "--store", str(tmp_path / "store"), "--size", "2", "--out", str(out)]) == 0
    ids = torch.load(out, weights_only=True)
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 7]  # 7 twice, then 3 beats 9 on a tie; prompt-only 5 never
    assert not list(out.parent.glob("*.tmp"))
