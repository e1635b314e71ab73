"""`draftheads check` against the real vLLM (its CPU build, `make vllm`) serving seeded broken exports of heads
trained on the cycling tiny target (tiny_heads, whose heads read the target's features: on the chaotic one, fc's
blocks swapped change its EAGLE-3 head's acceptance by less than the noise): each breakage moves vLLM's acceptance
far from the engine's, and the check exits 1 naming it, found by reading the export vLLM serves; the healthy export
passes.

- healthy: the check exports the EAGLE-3 head and starts vLLM itself;
- aux layer order: an export listing the aux layers as 2, 3, 1 with fc's blocks in that order (what an exporter that
  ignores vLLM's ascending capture writes for a head trained on layers 2, 3, 1), served by a running vLLM
  (--vllm-endpoint, --vllm-export): vLLM feeds every block another layer than it was trained on;
- fc bias: an EAGLE-1 head trained with fc's bias (biased_eagle), exported with it (vLLM's EagleLlamaForCausalLM has none; its
  loader drops the tensor), given as --vllm-export; the head itself is refused for vLLM by the check's own export;
- rope: a running vLLM serving a copy of the target whose config.json has rope_theta 10 for 10000 (found from the
  server's /v1/models root; the cycling target's answers follow its tokens more than their positions, so a rope
  that far off lowers the head's acceptance by about half).

One vLLM start each (about a minute on 2 cores). The prompts are 16 of the store's, where the heads accept about
half of their first drafts, so a broken export's gap lies far beyond the noise."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import heads
import tiny_heads
from serving import targets
from serving.bench.vllm_process import VllmServer
from training import export as exporting
from training.cli import main

pytestmark = pytest.mark.usefixtures("vllm_available")

K = 4
NUM_PROMPTS, MAX_TOKENS = 64, 32  # the store's
NUM_CHECKED = 16
START_TIMEOUT = 300
ROTATED = [2, 3, 1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, vllm_available):
    """The cycling target, its store's prompts as a prompt file, an EAGLE-3 head and an EAGLE-1 head with fc's bias."""
    root = tmp_path_factory.mktemp("check-vllm")
    target = tiny_heads.cycling_target(root / "target")
    store = tiny_heads.store(target, root / "data", NUM_PROMPTS, MAX_TOKENS)
    with torch.random.fork_rng():
        eagle3 = tiny_heads.train("eagle3", target, store, root / "eagle3", ("--trainer.max_steps=400",))
    return root, target, root / "data" / "prompts.jsonl", eagle3, biased_eagle(target, store, root)


def biased_eagle(target, store, root):
    """An EAGLE-1 head whose fc bias carries its drafts. A bias trained from nn.Linear's small start stays small here
    (norm 0.4 against fc's 16 after 40 steps: vLLM dropping it changes no acceptance on this target), so the fit
    starts from fc's bias drawn from N(0, 1), about the size of fc's output, and the head learns around it."""
    parts = heads.load_target_parts(target, fingerprint=targets.fingerprint(target))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        start = heads.Eagle.from_target(parts, fc_bias=True)
        with torch.no_grad():
            start.fc.bias.normal_()
        heads.save(start, root / "eagle-start")
        return tiny_heads.train("eagle", target, store, root / "eagle", (
            "--model.init_args.fc_bias=true", f"--model.init_args.init_from={root / 'eagle-start'}",
            "--trainer.max_steps=200"))


def check(head, target, prompts, capsys, *extra) -> tuple[int, str]:
    code = main(["check", str(head), "--target", str(target), "--prompts", str(prompts), "--num-prompts",
                 str(NUM_CHECKED), "--max-new-tokens", str(MAX_TOKENS), "--num-speculative-tokens", str(K),
                 "--vllm-timeout", str(START_TIMEOUT), *extra])
    out = capsys.readouterr().out
    print(out)
    return code, out


def engine_counts(out: str) -> list[int]:
    """The engine column's chains per position, from the printed table."""
    header, _, *rows = [line for line in out.splitlines() if line.startswith("|")]
    column = [cell.strip() for cell in header.split("|")].index("engine")
    return [int(row.split("|")[column].split("(")[1].rstrip(") ")) for row in rows]


def vllm_export(head_folder, target, out):
    return exporting.export(heads.load(head_folder).bind_target(heads.load_target_parts(target)), "vllm", out)


def test_check_passes_the_healthy_export_it_serves_itself(workspace, capsys):
    root, target, prompts, eagle3, _ = workspace
    code, out = check(eagle3, target, prompts, capsys, "--vllm", "on")
    assert code == 0 and "ok: the columns agree within their noise" in out
    assert "| position | engine | vllm |" in out and min(engine_counts(out)) > 0


def test_check_names_fc_blocks_in_another_order_than_vllm_captures(workspace, capsys):
    root, target, prompts, eagle3, _ = workspace
    export = vllm_export(eagle3, target, root / "rotated")
    config = json.loads((export / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(tiny_heads.AUX_LAYERS)
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ROTATED
    (export / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(export / "model.safetensors"))
    blocks = dict(zip(tiny_heads.AUX_LAYERS, tensors["fc.weight"].chunk(len(ROTATED), dim=1)))
    tensors["fc.weight"] = torch.cat([blocks[layer] for layer in ROTATED], dim=1).contiguous()
    save_file(tensors, str(export / "model.safetensors"), {"format": "pt"})
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": K}
    with VllmServer(target, spec, timeout=START_TIMEOUT) as server:
        code, out = check(eagle3, target, prompts, capsys, "--vllm-endpoint", server.url, "--vllm-export", str(export))
    assert code == 1
    assert "MISMATCH: position 1 accepts" in out and "in vllm vs" in out
    assert "found aux layer order: vLLM captures the export's layer ids [2, 3, 1] ascending ([1, 2, 3])" in out
    assert ("the block trained on layer 2 reads layer 1, the block trained on layer 3 reads layer 2, the block trained "
            "on layer 1 reads layer 3") in out


def test_check_names_the_fc_bias_vllm_drops(workspace, capsys):
    root, target, prompts, _, eagle = workspace
    head = heads.load(eagle)
    assert head.config.fc_bias and bool(head.fc.bias.ne(0).any())
    code, out = check(eagle, target, prompts, capsys, "--vllm", "on")  # the check's own export refuses it
    assert code == 1 and "MISMATCH: vLLM cannot serve this head: vllm's EAGLE-1 layer has no bias on fc" in out
    # an export that writes it anyway: the head's other tensors under vLLM's names, and fc.bias
    plain = heads.Eagle.from_target(heads.load_target_parts(target), fc_bias=False)
    plain.load_state_dict({name: t for name, t in head.state_dict().items() if name != "fc.bias"})
    export = exporting.export(plain.bind_target(heads.load_target_parts(target)), "vllm", root / "biased")
    tensors = load_file(str(export / "model.safetensors"))
    save_file({**tensors, "fc.bias": head.fc.bias.detach().contiguous()}, str(export / "model.safetensors"),
              {"format": "pt"})
    code, out = check(eagle, target, prompts, capsys, "--vllm-export", str(export))
    assert code == 1 and "in vllm vs" in out
    assert "found the export holds fc.bias, which vLLM's EagleLlamaForCausalLM has no parameter for" in out
    assert "drops an unexpected bias silently" in out


def test_check_names_the_rope_of_the_target_vllm_serves(workspace, capsys):
    root, target, prompts, eagle3, _ = workspace
    served = root / "target-rope"
    shutil.copytree(target, served)
    config = json.loads((served / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    config["rope_parameters"]["rope_theta"] = 10.0  # measured: 100 moves vLLM's acceptance by the noise only
    (served / "config.json").write_text(json.dumps(config))
    export = vllm_export(eagle3, target, root / "healthy")
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": K}
    with VllmServer(served, spec, timeout=START_TIMEOUT) as server:
        code, out = check(eagle3, target, prompts, capsys, "--vllm-endpoint", server.url)
    assert code == 1 and "in vllm vs" in out
    assert f"found vLLM serves the target {served} with rope_theta 10, the engine ran {target} with rope_theta 10000" in out
