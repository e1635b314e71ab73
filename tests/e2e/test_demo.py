"""The whole pipeline on the `debug` target with a tiny budget: generate, fit the demo's kinds, export, bench."""
import json

import torch
import yaml

import heads
from serving.spec_decode.config import TAKES_TOKEN_MAP
from training import demo


def test_demo_pipeline_writes_every_result_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    demo.main(["--target", "debug", "--num-prompts", "6", "--max-new-tokens", "12", "--epochs", "1",
               "--bench-mt-bench", "2", "--bench-humaneval", "1", "--bench-new-tokens", "10", "--concurrency", "3",
               "--serve-prompts", "2"])
    results = json.loads((tmp_path / "results" / "bench.json").read_text())
    assert [r["name"] for r in results] == ["mt-bench T=0 c=1", "humaneval T=0 c=1"]
    for result in results:
        methods = [row["method"] for row in result["rows"]]
        trees = [f"{kind} top{demo.TREE['topk']} n{demo.TREE['num_draft_tokens']}" for kind in demo.DEMO_KINDS
                 if kind in demo.TREE_KINDS]
        lookup_first = [f"{kind}+lookup2 p>={demo.CONFIDENCE_THRESHOLD:g}" for kind in demo.DEMO_KINDS]
        suffix_first = [f"{kind}+suffix1 p>={demo.CONFIDENCE_THRESHOLD:g}" for kind in demo.DEMO_KINDS
                        if kind in demo.SUFFIX_FIRST_KINDS]
        adaptive = [f"{kind} adaptive" for kind in demo.DEMO_KINDS if kind in demo.ADAPTIVE_KINDS]
        assert methods == ["plain", "ngram", "suffix k24 n25", *demo.DEMO_KINDS, *trees, *lookup_first, *suffix_first,
                           *adaptive]
        # greedy at concurrency 1: transformers' generate ran alongside, in float32 with the same tokens (in the
        # bfloat16 compute mode, which the demo picks on a CPU with AVX512-BF16, transformers' residual stream is
        # bfloat16 and its tokens may differ)
        assert result["dtype"] == demo.auto_dtype("auto")
        assert result["identical_to_hf"] is True or result["dtype"] == "bfloat16"
        assert result["speed_vs_hf"] == result["rows"][0]["tokens_per_s"] / result["hf_tokens_per_s"]
        for row in result["rows"]:
            assert {"tau", "acceptance_rate", "rows_per_step", "per_position", "tokens_per_s", "speedup",
                    "identical_to_plain"} <= row.keys()
            assert row["speed_vs_hf"] == row["tokens_per_s"] / result["hf_tokens_per_s"]
            assert row["identical_to_plain"] is True, row["method"]
            assert row["tau"] >= 1.0
        for row in result["rows"][1:]:
            if row["method"] in trees:  # a tree: more rows than depths, as deep as its best nodes go
                assert row["config"]["topk"] == demo.TREE["topk"] and row["rows_per_step"] > 1 + demo.NUM_SPECULATIVE_TOKENS
                assert 1 <= len(row["per_position"]) <= demo.NUM_SPECULATIVE_TOKENS
                continue
            if row["method"] in lookup_first + suffix_first:  # chains end early (suffix trees reach further)
                assert row["method"] in suffix_first or len(row["per_position"]) <= demo.NUM_SPECULATIVE_TOKENS
                assert row["config"]["confidence_threshold"] == demo.CONFIDENCE_THRESHOLD
                assert row["config"]["prompt_lookup_first"] is (row["method"] in lookup_first)
                assert row["config"]["suffix_first"] is (row["method"] in suffix_first)
                continue
            if row["method"] in adaptive:  # the policy's depth each step, up to the fixed chain's
                assert row["config"]["adaptive"] is True
                assert len(row["per_position"]) <= demo.NUM_SPECULATIVE_TOKENS
                continue
            if row["config"]["method"] == "suffix":  # a tree up to vLLM's depth 24
                assert 1 <= len(row["per_position"]) <= row["config"]["num_speculative_tokens"]
                continue
            assert len(row["per_position"]) == demo.NUM_SPECULATIVE_TOKENS
            assert {"position", "proposed", "reached", "accepted", "conditional", "survival"} <= row["per_position"][0].keys()
            assert row["per_category"]
    markdown = (tmp_path / "results" / "bench.md").read_text()
    assert "| eagle3 |" in markdown and "tau per category" in markdown and "| vs generate |" in markdown
    assert (tmp_path / "results" / "acceptance.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())["rows"]
    assert [(r["prompts"], r["method"]) for r in summary] == [(r["prompts"], row["method"]) for r in results for row in r["rows"]]
    assert "| humaneval (1) | 0 | 1 | eagle3 |" in (tmp_path / "results" / "summary.md").read_text()
    assert (tmp_path / "results" / "speedup_vs_concurrency.png").stat().st_size > 10_000
    assert len(list((tmp_path / "results" / "settings").glob("*.json"))) == 2
    online = json.loads((tmp_path / "results" / "serve" / "bench_serve.json").read_text())  # the best head served vs plain
    assert [run["label"] for run in online["runs"]] == [f"eagle3+lookup2 p>={demo.CONFIDENCE_THRESHOLD:g}", "plain"]
    assert all(run["num_completed"] == 2 for run in online["runs"]) and online["ratios"]["output_throughput"] > 0
    for kind in demo.DEMO_KINDS:
        assert (tmp_path / "runs" / kind / "heads" / "best" / "model.safetensors").exists()
        fit_config = yaml.safe_load((tmp_path / "runs" / kind / "config.yaml").read_text())
        assert fit_config["trainer"]["precision"] == demo.fit_precision()
    [token_map] = (tmp_path / "runs").glob("token_map-*.pt")
    for kind in set(demo.DEMO_KINDS) & set(TAKES_TOKEN_MAP):  # the bench drafts among each head's own map, given none
        assert torch.equal(heads.load(tmp_path / "runs" / kind / "heads" / "best").token_map, torch.load(token_map))
    # A second run with the same settings reuses the store and every head.
    stamps = {kind: (tmp_path / "runs" / kind / "heads" / "best" / "model.safetensors").stat().st_mtime_ns for kind in demo.DEMO_KINDS}
    # (With no bench prompts the bench is skipped: the heads alone.)
    again = demo.main(["--target", "debug", "--num-prompts", "6", "--max-new-tokens", "12", "--epochs", "1",
                       "--bench-mt-bench", "0", "--bench-humaneval", "0", "--serve-prompts", "0", "--concurrency", "3",
                       "--kinds", ",".join(demo.DEMO_KINDS)])
    assert again == {}
    assert stamps == {kind: (tmp_path / "runs" / kind / "heads" / "best" / "model.safetensors").stat().st_mtime_ns
                      for kind in demo.DEMO_KINDS}


def test_bench_sizes_default_to_the_demo_or_the_full_bench_and_explicit_sizes_win():
    assert (demo.parse_args([]).bench_mt_bench, demo.parse_args([]).bench_humaneval) == (8, 4)
    assert demo.parse_args([]).kinds == "medusa,eagle3,peagle,dflash"
    full = demo.parse_args(["--full"])
    assert (full.bench_mt_bench, full.bench_humaneval) == (80, 164)
    assert full.kinds == "medusa,eagle,eagle3,mtp,peagle,dflash,dspark"
    assert demo.parse_args(["--full", "--kinds", "mtp"]).kinds == "mtp"
    reduced = demo.parse_args(["--full", "--bench-mt-bench", "16", "--bench-humaneval", "0"])
    assert (reduced.bench_mt_bench, reduced.bench_humaneval) == (16, 0)
    assert list(demo.bench_prompts(reduced)) == ["mt-bench"]  # a set of 0 prompts is left out
    assert [len(prompts) for prompts, _ in demo.bench_prompts(reduced).values()] == [16]


def test_stores_of_other_compute_dtypes_are_kept_apart():
    assert str(demo.store_folder(demo.parse_args(["--dtype", "float32"]))) == "data/demo-smollm2-135m-instruct"
    bf16 = demo.parse_args(["--target", "org/model", "--dtype", "bfloat16", "--data", "d"])
    assert str(demo.store_folder(bf16)) == "d/demo-org_model-bfloat16"


def test_the_demo_computes_in_bfloat16_where_the_cpu_multiplies_it_natively(monkeypatch):
    from serving import cpu_features

    for flags, device, expected in [("avx2 fma avx512f avx512_bf16", "cpu", "bfloat16"),
                                    ("avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile", "cpu", "bfloat16"),
                                    ("avx2 fma avx512f", "cpu", "float32"), ("avx2 fma", "auto", "float32")]:
        monkeypatch.setattr(cpu_features, "cpu_features", lambda: cpu_features.CpuFeatures("a CPU", frozenset(flags.split())))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert demo.parse_args(["--device", device]).dtype == expected
        assert demo.parse_args(["--device", device, "--dtype", "float32"]).dtype == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # on a GPU the demo keeps float32 unless told
    assert demo.auto_dtype("auto") == "float32"


def test_the_demo_fits_in_bfloat16_mixed_precision_only_where_bfloat16_products_are_native(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for avx512_bf16, amx, expected in [(True, False, "bf16-mixed"), (False, True, "bf16-mixed"), (False, False, "32-true")]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        assert demo.fit_precision() == expected
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the probes: the safe choice
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert demo.fit_precision() == "32-true"
