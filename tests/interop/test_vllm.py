"""This project's exports served by the real vLLM (its CPU build, `make vllm`): per head kind vLLM serves, a head
briefly trained on a tiny target is exported, served by `vllm serve` on 127.0.0.1, and the same greedy float32
prompts go through vLLM and through this project's engine. Outputs must be equal token for token (both equal to
plain decoding), and so must the accepted drafts per position and the number of drafting steps, read from vLLM's
/metrics and from the engine's AcceptanceStats.

One vLLM start per served head (about a minute each on 2 cores); the slowest part is that start."""
from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import heads
import tiny_heads
from serving.engine import Engine
from serving.request import SamplingParams
from training import export as exporting
from vllm_server import VllmServer

pytestmark = pytest.mark.usefixtures("vllm_available")

K = 4  # num_speculative_tokens
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, vllm_available):
    """The tiny target, its store and a briefly trained head of each kind."""
    root = tmp_path_factory.mktemp("interop")
    target = tiny_heads.chaotic_target(root / "target")
    store = tiny_heads.store(target, root / "data")
    with torch.random.fork_rng():
        trained = {kind: tiny_heads.train(kind, target, store, root / kind) for kind in tiny_heads.FIT}
    return root, target, trained


@pytest.fixture(scope="module")
def prompt_ids(workspace):
    _, target, _ = workspace
    engine = Engine(str(target), max_num_seqs=1)
    return [engine.encode(messages) for messages in tiny_heads.prompts()]


def ours(target, spec: dict | None, prompt_ids) -> tuple[list[list[int]], dict | None]:
    """This project's engine, one prompt at a time: the outputs, and its drafting steps and accepted tokens per
    position counted as vLLM counts them.

    vLLM drafts num_speculative_tokens at every step, also where fewer tokens remain before max_tokens, and counts
    what the target accepts there (the output is cut afterwards); this engine drafts no deeper than the tokens that
    remain. So the engine runs with K more tokens of room, and its verify steps are counted while the output is
    shorter than MAX_TOKENS, as vLLM's are: the same drafts and verdicts, counted by vLLM's rule."""
    engine = Engine(str(target), max_num_seqs=1, speculative_config=spec)
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


def theirs(server: VllmServer, prompt_ids) -> tuple[list[list[int]], dict]:
    """vLLM: the outputs of the prompts sent one at a time, and the counters its /metrics grew by."""
    outputs = [server.complete(ids, MAX_TOKENS) for ids in prompt_ids]
    counters = {}
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            if sample.name == "vllm:spec_decode_num_drafts_total":
                counters["num_drafts"] = int(sample.value)
            if sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                counters.setdefault("per_position", {})[int(sample.labels["position"])] = int(sample.value)
    per_position = counters.pop("per_position", {})
    counters["accepted"] = [per_position[i] for i in sorted(per_position)]
    return outputs, counters


@pytest.fixture(scope="module")
def plain(workspace, prompt_ids):
    _, target, _ = workspace
    return ours(target, None, prompt_ids)[0]


def export_for_vllm(kind, folder, target, out):
    head = heads.load(folder)
    head.bind_target(heads.load_target_parts(target))
    return exporting.export(head, "vllm", out)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
def test_vllm_serves_our_export_with_our_outputs_and_acceptance(kind, workspace, prompt_ids, plain):
    root, target, trained = workspace
    exported = export_for_vllm(kind, trained[kind], target, root / f"vllm-{kind}")
    spec = {"method": kind, "num_speculative_tokens": K}
    our_outputs, our_counts = ours(target, {**spec, "model": str(trained[kind]), "draft_weights": "float32"}, prompt_ids)
    with VllmServer(target, {**spec, "model": str(exported)}) as server:
        their_outputs, their_counts = theirs(server, prompt_ids)
    assert our_outputs == plain
    assert their_outputs == plain, "vLLM's speculative outputs differ from plain greedy decoding"
    assert sum(our_counts["accepted"]) > 0, f"the {kind} head accepts nothing: the comparison would prove little"
    assert their_counts == our_counts
