"""This project's exports served by the real vLLM (its CPU build, `make vllm`): per head kind vLLM serves, a head
briefly trained on a tiny target is exported, served by `vllm serve` on 127.0.0.1, and the same greedy float32
prompts go through vLLM and through this project's engine. Outputs must be equal token for token (both equal to
plain decoding), and so must the accepted drafts per position and the number of drafting steps, read from vLLM's
/metrics and from the engine's AcceptanceStats.

One vLLM start per served head (about a minute each on 2 cores); the slowest part is that start."""
from __future__ import annotations

import json

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

import heads
import speculators_process
import tiny_heads
from heads.token_map import lm_head_rows
from serving.bench.bench_serve import BenchServeConfig, arrival_times, load_first_turns, make_report, measure, to_markdown
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from training import export as exporting
from training.data.generate import GenerateConfig, generate
from training.data.store import Store
from training.import_head import import_head
from serving.bench.vllm_process import VllmServer

pytestmark = pytest.mark.usefixtures("vllm_available")

K = 4  # num_speculative_tokens
MAX_TOKENS = 24


class Trained(dict):
    """A briefly trained head of each kind, trained when first asked for (each fit seeds itself), so that a test
    runs only the fits it reads."""

    def __init__(self, root, target, store):
        super().__init__()
        self.root, self.target, self.store = root, target, store

    def __missing__(self, kind):
        with torch.random.fork_rng():
            self[kind] = tiny_heads.train(kind, self.target, self.store, self.root / kind)
        return self[kind]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, vllm_available):
    """The tiny target, its store and the heads trained on it (Trained)."""
    root = tmp_path_factory.mktemp("interop")
    target = tiny_heads.chaotic_target(root / "target")
    return root, target, Trained(root, target, tiny_heads.store(target, root / "data"))


@pytest.fixture(scope="module")
def prompt_ids(workspace):
    _, target, _ = workspace
    engine = Engine(EngineConfig(str(target), max_num_seqs=1))
    return [engine.encode(messages) for messages in tiny_heads.prompts()]


def ours(target, spec: dict | None, prompt_ids) -> tuple[list[list[int]], dict | None]:
    """This project's engine, one prompt at a time: the outputs, and its drafting steps and accepted tokens per
    position counted as vLLM counts them.

    vLLM drafts num_speculative_tokens at every step, also where fewer tokens remain before max_tokens, and counts
    what the target accepts there (the output is cut afterwards); this engine drafts no deeper than the tokens that
    remain. So the engine runs with K more tokens of room, and its verify steps are counted while the output is
    shorter than MAX_TOKENS, as vLLM's are: the same drafts and verdicts, counted by vLLM's rule."""
    engine = Engine(EngineConfig(str(target), max_num_seqs=1, speculative_config=spec))
    if spec is None:
        outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        return [o.token_ids for o in outputs], None
    stats, steps = engine.speculator.stats, []
    record = stats.record

    def spy(tree, path, num_emitted):
        if len(tree):
            steps[-1].append(len(path))
        record(tree, path, num_emitted)

    stats.record = spy
    outputs, counts = [], {"num_drafts": 0, "accepted": [0] * K}
    for ids in prompt_ids:
        steps.append([])
        [output] = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS + K, ignore_eos=True))
        outputs.append(output.token_ids[:MAX_TOKENS])
        num_output = 1  # the prefill's token
        for num_accepted in steps[-1]:
            if num_output >= MAX_TOKENS:
                break
            counts["num_drafts"] += 1
            for i in range(num_accepted):
                counts["accepted"][i] += 1
            num_output += num_accepted + 1
    return outputs, counts


def spec_counters(server: VllmServer) -> dict:
    """vLLM's drafting steps and accepted tokens per position so far, from /metrics."""
    counters, per_position = {"num_drafts": 0}, {}
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            if sample.name == "vllm:spec_decode_num_drafts_total":
                counters["num_drafts"] = int(sample.value)
            if sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                per_position[int(sample.labels["position"])] = int(sample.value)
    counters["accepted"] = [per_position.get(i, 0) for i in range(K)]
    return counters


def theirs(server: VllmServer, prompt_ids) -> tuple[list[list[int]], dict]:
    """vLLM: the outputs of the prompts sent one at a time, and what its counters grew by meanwhile."""
    before = spec_counters(server)
    outputs = [server.complete(ids, MAX_TOKENS) for ids in prompt_ids]
    after = spec_counters(server)
    return outputs, {"num_drafts": after["num_drafts"] - before["num_drafts"],
                     "accepted": [a - b for a, b in zip(after["accepted"], before["accepted"])]}


@pytest.fixture(scope="module")
def plain(workspace, prompt_ids):
    _, target, _ = workspace
    return ours(target, None, prompt_ids)[0]


def bound(folder, target):
    """The head in `folder` bound to the target (the speculators format carries the target's embedding)."""
    return heads.load(folder).bind_target(heads.load_target_parts(target))


def export_for_vllm(kind, folder, target, out):
    return exporting.export(bound(folder, target), "vllm", out)


def compare(target, trained, spec, server, prompt_ids, plain) -> None:
    our_outputs, our_counts = ours(target, {**spec, "model": str(trained), "draft_weights": "float32"}, prompt_ids)
    their_outputs, their_counts = theirs(server, prompt_ids)
    assert our_outputs == plain
    assert their_outputs == plain, "vLLM's speculative outputs differ from plain greedy decoding"
    assert sum(our_counts["accepted"]) > 0, f"the {spec['method']} head accepts nothing: the comparison would prove little"
    assert their_counts == our_counts


@pytest.fixture(scope="module")
def speculators_server(workspace):
    """vLLM serving the EAGLE-3 head's speculators export as its model, as vLLM's docs serve speculators: the
    target is the verifier its config.json names, the draft length the one it proposes."""
    root, target, trained = workspace
    exported = exporting.export(bound(trained["eagle3"], target), "speculators", root / "speculators-eagle3", verifier=target,
                                num_speculative_tokens=K)
    with VllmServer(exported, None) as server:
        yield server


def test_vllm_serves_our_speculators_export_given_as_its_model(workspace, prompt_ids, plain, speculators_server):
    _, target, trained = workspace
    compare(target, trained["eagle3"], {"method": "eagle3", "num_speculative_tokens": K}, speculators_server,
            prompt_ids, plain)


def test_vllm_serves_our_speculators_peagle_export_with_parallel_drafting(workspace, prompt_ids, plain):
    """vLLM reads a speculators P-EAGLE export as EAGLE-3 with parallel drafting (all drafts from one forward, the
    mask token and mask_hidden in the placeholder rows): the same outputs and accepted drafts per position as ours."""
    root, target, trained = workspace
    exported = exporting.export(bound(trained["peagle"], target), "speculators", root / "speculators-peagle",
                                verifier=target, num_speculative_tokens=K)
    with VllmServer(exported, None) as server:
        compare(target, trained["peagle"], {"method": "peagle", "num_speculative_tokens": K}, server, prompt_ids,
                plain)


def test_vllm_serves_our_speculators_dflash_export(workspace, prompt_ids, plain):
    """vLLM reads a speculators DFlash export (the target's features as extra K/V in every drafter layer, a block
    of the newest token and mask tokens drafted in one forward): the same outputs and accepted drafts per position."""
    root, target, trained = workspace
    head = heads.load(trained["dflash"])
    head.bind_target(heads.load_target_parts(target))  # the export carries the target's embedding and LM head
    exported = exporting.export(head, "speculators", root / "speculators-dflash", verifier=target,
                                num_speculative_tokens=K)
    with VllmServer(exported, None) as server:
        compare(target, trained["dflash"], {"method": "dflash", "num_speculative_tokens": K}, server, prompt_ids,
                plain)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
def test_vllm_serves_our_export_with_our_outputs_and_acceptance(kind, workspace, prompt_ids, plain):
    root, target, trained = workspace
    exported = export_for_vllm(kind, trained[kind], target, root / f"vllm-{kind}")
    spec = {"method": kind, "num_speculative_tokens": K}
    with VllmServer(target, {**spec, "model": str(exported)}) as server:
        compare(target, trained[kind], spec, server, prompt_ids, plain)


@pytest.mark.parametrize("norms, layout", [("norm_before_fc", "vllm"), ("fc_norm", "speculators")])
def test_vllm_serves_eagle31_norms_with_our_outputs_and_acceptance(norms, layout, workspace, prompt_ids, plain):
    """EAGLE-3 heads trained with EAGLE 3.1's norms (one over the aux states side by side, or one per aux state; the
    normed output fed back), exported with them: vLLM 0.32 drafts what the engine drafts."""
    root, target, _ = workspace
    with torch.random.fork_rng():
        trained = tiny_heads.train("eagle3", target, tiny_heads.store(target, root / "data"), root / f"eagle31-{norms}",
                                   tuple(tiny_heads.EAGLE31[norms]))
    head = bound(trained, target)
    assert head.config.norm_output and getattr(head.config, norms)
    spec = {"method": "eagle3", "num_speculative_tokens": K}
    if layout == "vllm":
        with VllmServer(target, {**spec, "model": str(export_for_vllm("eagle3", trained, target, root / f"vllm-{norms}"))}) as server:
            compare(target, trained, spec, server, prompt_ids, plain)
    else:
        exported = exporting.export(head, "speculators", root / f"speculators-{norms}", verifier=target,
                                    num_speculative_tokens=K)
        with VllmServer(exported, None) as server:
            compare(target, trained, spec, server, prompt_ids, plain)


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_vllm_serves_a_windowed_eagle3_head_with_our_outputs_and_acceptance(layout, workspace, prompt_ids, plain):
    """An EAGLE-3 head trained with draft_window 8 (fewer keys than any prompt), exported with layer_types
    ["sliding_attention"] and sliding_window 8: vLLM 0.32's EAGLE-3 drafter windows its Llama attention there, and
    drafts what the engine drafts."""
    root, target, _ = workspace
    with torch.random.fork_rng():
        trained = tiny_heads.train("eagle3", target, tiny_heads.store(target, root / "data"), root / "eagle3-window",
                                   ("--model.init_args.draft_window=8",))
    head = bound(trained, target)
    assert head.config.draft_window == 8 and min(map(len, prompt_ids)) > 8
    spec = {"method": "eagle3", "num_speculative_tokens": K}
    if layout == "vllm":
        with VllmServer(target, {**spec, "model": str(export_for_vllm("eagle3", trained, target, root / "vllm-window"))}) as server:
            compare(target, trained, spec, server, prompt_ids, plain)
    else:
        exported = exporting.export(head, "speculators", root / "speculators-window", verifier=target,
                                    num_speculative_tokens=K)
        with VllmServer(exported, None) as server:
            compare(target, trained, spec, server, prompt_ids, plain)


def test_generate_from_vllm_stores_what_the_engine_stores_where_the_answers_agree(workspace, speculators_server,
                                                                                 tmp_path):
    """`draftheads generate --endpoint` against vLLM: answers as vLLM's token ids (return_token_ids), hidden states
    from this project's teacher-forced pass, so each item equals the in-process store's where the answers agree
    (greedy float32 on both sides: here they all do)."""
    _, target, _ = workspace
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": m}) + "\n"
                               for i, m in enumerate(tiny_heads.prompts(4))))
    # prefill in chunks of 16 on both sides: the in-process run's hidden states come from its prefill and decode
    # steps, the endpoint's from one teacher-forced pass, and stored as bfloat16 they match bit for bit only when
    # both passes see the same chunks (with 512-token chunks they differ by one bfloat16 step here and there)
    common = dict(prompts=str(prompts), target=str(target), max_new_tokens=16, concurrency=4,
                  aux_layers=tiny_heads.AUX_LAYERS, max_num_batched_tokens=16, max_model_len=256)
    generate(GenerateConfig(out=str(tmp_path / "engine"), **common), progress=False)
    summary = generate(GenerateConfig(out=str(tmp_path / "vllm"), endpoint=speculators_server.url + "/v1", **common),
                       progress=False)
    assert summary["answer_ids"] == {"num_token_ids": 4, "num_from_text": 0, "dropped": []}
    in_process, from_vllm = Store(tmp_path / "engine"), Store(tmp_path / "vllm")
    assert from_vllm.meta["answers"] == {"source": "endpoint", "model": "target", "endpoint": speculators_server.url}
    expected = {item["id"]: item for item in in_process}
    agreed = 0
    for item in from_vllm:
        other = expected[item["id"]]
        if item["input_ids"].tolist() != other["input_ids"].tolist():
            continue
        agreed += 1
        assert item["loss_mask"].tolist() == other["loss_mask"].tolist()
        for key in ("last", "eagle3"):
            torch.testing.assert_close(item["hidden"][key], other["hidden"][key], rtol=0, atol=0)
    assert agreed == 4, "vLLM's greedy float32 answers differ from the engine's"


def test_bench_serve_measures_vllm_with_its_acceptance(speculators_server, tmp_path):
    """`draftheads bench-serve --endpoint VLLM`: the model it serves is found, every request completes, and the
    acceptance comes from vLLM's counters (mean acceptance length 1 + accepted / drafts)."""
    config = BenchServeConfig(endpoint=speculators_server.url, api="completions", prompts="mt-bench", num_prompts=2,
                              max_new_tokens=16, ignore_eos=True, max_concurrency=1)
    turns = load_first_turns(config.prompts, config.num_prompts)
    run = measure(config.endpoint, turns, arrival_times(len(turns), config.request_rate, 0), config, "vllm")
    assert run["model"] == "target" and run["num_completed"] == 2 and run["num_output_tokens"] == 32
    accepted = run["acceptance"]
    assert accepted["num_drafts"] > 0
    assert accepted["mean_acceptance_length"] == 1 + accepted["num_accepted_tokens"] / accepted["num_drafts"]
    assert "| vllm |" in to_markdown(make_report([run], config))


@pytest.fixture(scope="module")
def token_map(workspace):
    """The store's most frequent answer tokens, as the demo maps them (training/demo.py), in a file."""
    from training.data.vocab import frequent_tokens, write_token_map

    root, _, _ = workspace
    path = root / "token_map.pt"
    write_token_map(frequent_tokens(Store(root / "data" / "store"), tiny_heads.TOKEN_MAP_SIZE), path)
    return path


@pytest.mark.parametrize("kind, layout", [("medusa", "vllm"), ("dflash", "speculators"), ("dflash", "z-lab")])
def test_vllm_serves_a_head_over_a_token_map_as_we_do(kind, layout, workspace, token_map, prompt_ids, plain):
    """The demo's heads draft among a token map: Medusa with its own LM heads goes out with them over the whole
    vocabulary (the unmapped rows never win), DFlash as vLLM's draft vocabulary (d2t). vLLM drafts what we draft."""
    root, target, _ = workspace
    extra = ("--model.init_args.own_lm_head=true",) if kind == "medusa" else ()
    with torch.random.fork_rng():
        trained = tiny_heads.train(kind, target, root / "data" / "store", root / f"{kind}-token-map",
                                   (f"--model.init_args.token_map={token_map}", *extra))
    head = heads.load(trained)
    assert head.token_map is not None and len(head.token_map) == tiny_heads.TOKEN_MAP_SIZE
    parts = heads.load_target_parts(target)
    parts.lm_head = lm_head_rows(parts.lm_head, head.token_map)
    head.bind_target(parts)
    exported = exporting.export(head, layout, root / f"{kind}-{layout}-token-map", verifier=target,
                                num_speculative_tokens=K)
    spec = {"method": kind, "num_speculative_tokens": K}
    model, served = (exported, None) if layout == "speculators" else (target, {**spec, "model": str(exported)})
    with VllmServer(model, served) as server:
        compare(target, trained, spec, server, prompt_ids, plain)


def test_vllm_serves_what_speculators_writes_of_a_head_trained_with_norm_before_residual(workspace, prompt_ids, plain,
                                                                                        speculators_python):
    """An EAGLE-3 head trained here with speculators' default norm_before_residual, exported, read and written again
    by speculators' own from_pretrained / save_pretrained: vLLM serving that folder and this engine serving its
    import draft the same."""
    root, target, _ = workspace
    with torch.random.fork_rng():
        trained = tiny_heads.train("eagle3", target, root / "data" / "store", root / "eagle3-normed-residual",
                                   ("--model.init_args.norm_before_residual=true",))
    assert heads.load(trained).config.norm_before_residual
    exported = exporting.export(bound(trained, target), "speculators", root / "normed-residual-export", verifier=target,
                                num_speculative_tokens=K)
    written = root / "normed-residual-speculators"
    speculators_process.run("resave", "eagle3", exported, written)
    imported = heads.save(import_head(written, "eagle3", target)[0], root / "normed-residual-imported")
    with VllmServer(written, None) as server:
        compare(target, imported, {"method": "eagle3", "num_speculative_tokens": K}, server, prompt_ids, plain)


def test_vllm_serves_a_peagle_with_its_own_embedding_as_speculators_writes_it_as_we_do(workspace, prompt_ids, plain,
                                                                                    speculators_python):
    """A P-EAGLE head trained here with an embedding of its own (embed_requires_grad, speculators' P-EAGLE default),
    exported, read and written again by speculators' own from_pretrained / save_pretrained: the file keeps the head's
    embedding, vLLM drafts with it (it differs from the target's), and this engine serving its import drafts the
    same."""
    root, target, _ = workspace
    with torch.random.fork_rng():
        trained = tiny_heads.train("peagle", target, root / "data" / "store", root / "peagle-own-embedding",
                                   ("--model.init_args.embed_requires_grad=true",))
    head = bound(trained, target)
    assert head.config.own_embedding and not torch.equal(head.embed_tokens.weight, head.target.embed.weight)
    exported = exporting.export(head, "speculators", root / "own-embedding-export", verifier=target,
                                num_speculative_tokens=K)
    written = root / "own-embedding-speculators"
    speculators_process.run("resave", "peagle", exported, written)
    assert torch.equal(load_file(str(written / "model.safetensors"))["embed_tokens.weight"], head.embed_tokens.weight)
    imported = import_head(written, "peagle", target)[0]
    assert imported.config.own_embedding
    with VllmServer(written, None) as server:
        compare(target, heads.save(imported, root / "own-embedding-imported"),
                {"method": "peagle", "num_speculative_tokens": K}, server, prompt_ids, plain)
