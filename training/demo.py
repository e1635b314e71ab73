"""`make demo`: the main job on the built-in default target, from a fresh clone, on a CPU.

1. `draftheads generate`: the default target answers DEMO_PROMPTS ShareGPT train prompts (first turns, greedy,
   DEMO_NEW_TOKENS tokens at most), its hidden states captured in the same pass, into data/demo-store;
2. `draftheads token-map`: the store's 4,096 most frequent answer tokens, which Medusa, EAGLE-1 and MTP train and
   draft among (EAGLE-3 trains over the same ones as its draft vocabulary);
3. `draftheads fit` of Medusa, EAGLE-3, P-EAGLE and DFlash heads (with --full also EAGLE-1, MTP and DSpark) from configs/
   in offline mode on that store (in
   bf16-mixed precision where bfloat16 products are native, `fit_precision`),
   each exported to runs/<kind>/heads/best (the folders configs/ name);
4. `draftheads bench` on MT-bench first turns (one per category) and HumanEval (a fixed subset), concurrency 1,
   greedy, 4 depths: plain decoding, n-gram, suffix decoding and each trained head, as a chain always drafting 4
   tokens, as EAGLE-2's dynamic tree (`TREE`; only `TREE_KINDS` without --full), as a chain with a confidence
   threshold after prompt lookup first (`prompt_lookup_first`) and, for `SUFFIX_FIRST_KINDS`, after suffix decoding
   first (`suffix_first`), `ADAPTIVE_KINDS` alone under the adaptive policy (`"adaptive": true`), and
   transformers' `generate` on the same prompts (each row's "vs generate"); with --full also n-gram and each head
   after prompt lookup under the adaptive policy (`"adaptive": true`);
5. results/bench.json, results/bench.md, results/acceptance.png and the summary over every setting and method
   (results/summary.json, summary.md, speedup_vs_concurrency.png), also logged to an (offline) wandb run; with
   --full, in results/full/;
6. the online run: `draftheads serve` with the best head and plain, each measured by `draftheads bench-serve` on
   MT-bench prompts arriving over time (results/serve/: bench_serve.json, bench_serve.md, latency.png).

Every stage reuses what an earlier run produced with the same settings: generation resumes, a head whose
stamp matches is not trained again, and a bench setting whose result is in results/settings/ (results/full/settings/)
under the same options is not run again, so a killed `make bench-full` picks up at the first setting without one.
`python -m training.demo --help` lists the sizes; `--target debug` with tiny sizes smoke-tests the whole pipeline.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

KINDS = ("medusa", "eagle", "eagle3", "mtp", "peagle", "dflash", "dspark")
# What `make demo` trains and benches within its 30 minutes: the feature-free baseline, the best chain head and the
# two that draft a block per forward. EAGLE-1 and MTP draft as EAGLE-3 does (autoregressively, from the target's
# features); with all six kinds trained EAGLE-1 measured within 0.08 tau of EAGLE-3 in every row and MTP below
# it. --full and --kinds train them too, and DSpark (DFlash's block plus a Markov and a confidence head).
DEMO_KINDS = ("medusa", "eagle3", "peagle", "dflash")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# What the demo trains: configs/<kind>.yaml with configs/demo/<kind>.yaml laid over it (the recipe for a store of a
# few hundred examples: batch 2, short warmup, the epochs below, the store's 4,096 most frequent answer tokens), and
# the store configs/demo/generate.yaml writes; `draftheads fit -c configs/<kind>.yaml -c configs/demo/<kind>.yaml`
# trains the same head.
DEMO_CONFIGS = CONFIGS / "demo"
NUM_SPECULATIVE_TOKENS = 4
# The token map configs/demo/<kind>.yaml name (runs/token_map-4096.pt): every head drafts over the store's
# DRAFT_VOCAB_SIZE most frequent answer tokens (EAGLE-3 and P-EAGLE by training so, the others through the map), so
# each draft step reads a twelfth of the LM head. The demo's store holds ~5,300 distinct answer tokens, 97.8% of its
# answer tokens among the 4,096 most frequent.
DRAFT_VOCAB_SIZE = 4096
# Each head is benched three times: a chain always drafting k=4 (the goal's setting); EAGLE-2's dynamic tree over
# the same 4 depths (TREE: the 8 most likely children of the 8 best nodes at each depth, the 15 best nodes kept,
# the setting that raised tau most on MT-bench); and a chain after prompt lookup first, which drafts where the answer
# repeats earlier text and leaves the head the rest, ended before the draft where the product of the head's
# calibrated probabilities of its drafts falls below CONFIDENCE_THRESHOLD (the fastest setting measured). Chains cut
# without lookup (every head 1.09-1.18x on MT-bench's 80) are left to `draftheads bench`, to keep the demo within
# 30 minutes.
TREE = {"topk": 8, "num_draft_tokens": 16}
# The kinds `make demo` benches as trees (--full: every kind). Medusa's tree adds what the others' show (+0.26-0.36 tau
# in the six-kind demo) and its 16-row steps cost a minute of the 30.
TREE_KINDS = ("eagle", "eagle3", "mtp", "peagle", "dflash", "dspark")
# Suffix decoding (vLLM's defaults) beside n-gram, and the best head after suffix decoding first (suffix where its
# tree's own frequencies expect at least a token accepted, the head elsewhere) beside it after prompt lookup first.
SUFFIX_FIRST_KINDS = ("eagle3",)
# The best head alone under the adaptive policy (docs/methods/adaptive.md): each step it drafts as deep as its
# confidence in the draft in hand repays the rows and forwards, where the chain of 4 always drafts 4.
ADAPTIVE_KINDS = ("eagle3",)
# The online run's arrivals: about one request per 1.3 s of a request's decoding alone, so that requests overlap.
SERVE_RATE = 0.75
CONFIDENCE_THRESHOLD = 0.1


def demo_config(name: str) -> dict:
    """configs/demo/<name>.yaml's keys: `generate`, or a head kind's recipe."""
    import yaml

    return yaml.safe_load((DEMO_CONFIGS / f"{name}.yaml").read_text())


def demo_epochs(kind: str) -> int:
    return demo_config(kind)["trainer"]["max_epochs"]


def parse_args(argv=None):
    from serving.targets import DEFAULT_TARGET

    store = demo_config("generate")
    p = argparse.ArgumentParser(prog="python -m training.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--num-prompts", type=int, default=int(os.environ.get("DEMO_PROMPTS", store["num_prompts"])),
                   help="ShareGPT train prompts the target answers for training data")
    p.add_argument("--max-model-len", type=int, default=store["max_model_len"],
                   help="prompt + answer tokens at most while generating; longer prompts are skipped, so that most "
                        "training tokens are answer tokens, the ones with a loss")
    p.add_argument("--max-new-tokens", type=int, default=int(os.environ.get("DEMO_NEW_TOKENS", store["max_new_tokens"])))
    epochs = os.environ.get("DEMO_EPOCHS")
    p.add_argument("--epochs", type=int, default=int(epochs) if epochs else None,
                   help="training epochs of every head (default: configs/demo/<kind>.yaml's trainer.max_epochs)")
    p.add_argument("--bench-mt-bench", type=int, default=None,
                   help="MT-bench first turns, one per category in turn (default 8; 80 with --full); 0 with "
                        "--bench-humaneval 0 skips the bench")
    p.add_argument("--bench-humaneval", type=int, default=None, help="HumanEval prompts (default 4; 164 with --full)")
    p.add_argument("--bench-new-tokens", type=int, default=96)
    p.add_argument("--serve-prompts", type=int, default=8,
                   help="MT-bench prompts of the online run (draftheads serve with the best head vs plain, measured by "
                        "bench-serve at a fixed request rate); 0 skips it")
    p.add_argument("--kinds", default=None,
                   help=f"head kinds to train and bench, comma-separated (default {','.join(DEMO_KINDS)}; with --full "
                        f"{','.join(KINDS)})")
    p.add_argument("--data", default="data", help="where the store goes")
    p.add_argument("--results", default="results",
                   help="where the report goes (bench.json, bench.md, acceptance.png, summary.json, summary.md, "
                        "speedup_vs_concurrency.png; with --full in DIR/full), and each setting's result as it ends (in "
                        "settings/ there: a rerun with the same options reuses it, delete it to measure again)")
    p.add_argument("--concurrency", type=int, default=store["concurrency"],
                   help="conversations answered at once while generating (the answers are the same at any concurrency, "
                        "stored in another order; 64 wrote them 3-8%% faster than 32)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the target's compute dtype while generating, benching and serving (draftheads generate's and "
                        "bench's --dtype): bfloat16 multiplies bfloat16 weights by bfloat16 activations with float32 "
                        "sums, about twice float32's speed on a CPU with AVX512-BF16 (docs/benchmarks/engine.md); "
                        "its store and results are kept apart from float32's. auto (default): bfloat16 on a CPU whose "
                        "vector units multiply bfloat16 (AVX512-BF16 or AMX), float32 elsewhere")
    p.add_argument("--device", default="auto",
                   help="where the target generates and is benched: auto (the first CUDA GPU when torch sees one, else "
                        "the CPU), cpu, cuda or cuda:N; fits pick their accelerator themselves")
    p.add_argument("--full", action="store_true",
                   help="bench-full: every MT-bench question and HumanEval problem, greedy and temperature 0.7, "
                        "concurrency 1, 4 and 16 (hours on a CPU; a rerun picks up at the first setting without a result)")
    args = p.parse_args(argv)
    if args.bench_mt_bench is None:
        args.bench_mt_bench = 80 if args.full else 8
    if args.bench_humaneval is None:
        args.bench_humaneval = 164 if args.full else 4
    if args.kinds is None:
        args.kinds = ",".join(KINDS if args.full else DEMO_KINDS)
    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        p.error(f"--kinds: unknown kind(s) {', '.join(unknown)}; choose among {', '.join(KINDS)}")
    if args.dtype == "auto":
        args.dtype = auto_dtype(args.device)
    return args


def auto_dtype(device: str) -> str:
    """bfloat16 compute where the CPU runs it natively (products on vdpbf16ps or AMX tiles, about twice float32's
    speed), float32 on other CPUs and on GPUs. Widened to float32 on an AVX2 CPU, bfloat16 still halves the bytes a
    decode step streams, so plain decoding gains, but a verify step's rows then cost arithmetic that the shorter
    stream no longer hides, so speculation gains less: the demo measures speculation in float32 there."""
    from serving.config import resolve_device
    from serving.cpu_features import cpu_features

    native = cpu_features().supports("avx512_bf16")  # every CPU with AMX has it too
    return "bfloat16" if resolve_device(device).type == "cpu" and native else "float32"


def stage(title: str):
    print(f"\n==> {title}", flush=True)
    return time.perf_counter()


def main(argv=None) -> dict:
    args = parse_args(argv)
    from serving.targets import resolve

    start = stage(f"target {args.target}")
    print(resolve(args.target))
    store = generate(args)
    token_map = make_token_map(store)
    heads = {kind: fit(args, kind, store, token_map) for kind in args.kinds.split(",")}
    result = bench(args, heads) if args.bench_mt_bench or args.bench_humaneval else {}
    if args.serve_prompts and heads:
        result["serve"] = serve(args, heads)
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")
    return result


def generate(args) -> Path:
    from training.data.generate import GenerateConfig, generate as run_generate

    out = store_folder(args)
    t = stage(f"generate: {args.num_prompts} ShareGPT prompts x {args.max_new_tokens} tokens -> {out} (resumes)")
    run_generate(GenerateConfig.from_options(dict(
        config=str(DEMO_CONFIGS / "generate.yaml"), target=args.target, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, concurrency=args.concurrency, max_model_len=args.max_model_len,
        dtype=args.dtype, device=args.device, out=str(out))))
    print(f"generate took {time.perf_counter() - t:.0f} s")
    return out


def store_folder(args) -> Path:
    """data/demo-<target>, with the dtype after it unless float32: stores of other compute dtypes hold other answers."""
    return Path(args.data) / f"demo-{args.target.replace('/', '_')}{'' if args.dtype == 'float32' else '-' + args.dtype}"


def fit(args, kind: str, store: Path, token_map: Path) -> Path:
    from training.fit import main as fit_main

    configs = [CONFIGS / f"{kind}.yaml", DEMO_CONFIGS / f"{kind}.yaml"]
    root = Path("runs") / kind  # where configs/<kind>.yaml puts its run, checkpoints and head folders
    head = root / "heads" / "best"
    meta = json.loads((store / "meta.json").read_text())
    # The store and the token map are the ones this run wrote (another target's with --target); the precision is
    # the machine's.
    overrides = ["--data.store", str(store), "--trainer.precision", fit_precision()]
    if "token_map" in demo_config(kind)["model"]["init_args"]:
        overrides += ["--model.init_args.token_map", str(token_map)]
    if args.epochs:
        overrides += ["--trainer.max_epochs", str(args.epochs)]
    settings = {"kind": kind, "target": args.target, "store": str(store), "counts": meta["counts"],
                "overrides": overrides, "configs": [hashlib.sha256(c.read_bytes()).hexdigest()[:12] for c in configs]}
    stamp = root / "demo-stamp.json"
    if head.exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        stage(f"fit {kind}: reusing {head} (same store and settings)")
        return head
    t = stage(f"fit {kind}: {' + '.join(str(c.relative_to(CONFIGS.parent)) for c in configs)} on {store}")
    fit_main("fit", [arg for config in configs for arg in ("-c", str(config))]
             + ["--model.init_args.target", args.target, *overrides])
    stamp.write_text(json.dumps(settings))
    print(f"fit {kind} took {time.perf_counter() - t:.0f} s")
    return head


def fit_precision() -> str:
    """bf16-mixed where bfloat16 matrix products run natively (a CUDA GPU that has them, a CPU with AVX512-BF16 or
    AMX), 32-true elsewhere, where bfloat16 is emulated and slower. On this project's AVX512-BF16 CPU an EAGLE-1
    epoch of the demo took 30-36 s instead of 46, and every kind's held-out accuracy was the same (docs/training.md)."""
    import torch

    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    native = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return "bf16-mixed" if any(f is not None and f() for f in native) else "32-true"


def make_token_map(store: Path) -> Path:
    """Medusa, EAGLE-1 and MTP train and draft over the same most frequent answer tokens as EAGLE-3 (FR-Spec)."""
    from training.data.store import Store
    from training.data.vocab import frequent_tokens, write_token_map

    data = Store(store)
    size = min(DRAFT_VOCAB_SIZE, data.meta["target"]["fingerprint"]["vocab_size"])
    path = Path("runs") / f"token_map-{size}.pt"
    write_token_map(frequent_tokens(data, size), path)
    return path


def serve(args, heads: dict) -> dict:
    """The online run: `draftheads serve` with the best head (EAGLE-3 after prompt lookup, chains cut at
    CONFIDENCE_THRESHOLD, the fastest offline setting) and plain, each measured by `draftheads bench-serve` on the
    same MT-bench prompts arriving at SERVE_RATE requests per second (Poisson), greedy."""
    from serving.bench.bench_serve import serve_and_bench, to_markdown

    kind = "eagle3" if "eagle3" in heads else next(iter(heads))
    config = {"method": kind, "model": str(heads[kind]), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
              "prompt_lookup_first": True, "confidence_threshold": CONFIDENCE_THRESHOLD}
    out = Path(args.results) / ("full" if args.full else "") / "serve"
    t = stage(f"serve: {kind} after prompt lookup vs plain, {args.serve_prompts} MT-bench prompts x "
              f"{args.bench_new_tokens} tokens at {SERVE_RATE} requests/s")
    report = serve_and_bench(args.target, config, prompts="mt-bench", num_prompts=args.serve_prompts,
                             max_new_tokens=args.bench_new_tokens, request_rate=SERVE_RATE, out=out,
                             serve_options=["--device", args.device, "--dtype", args.dtype])
    print(to_markdown(report))
    print(f"took {time.perf_counter() - t:.0f} s; wrote {out}")
    return report


def bench_prompts(args):
    from serving.bench.prompts import first_turn, load_prompts

    sets = {name: list(load_prompts(name, limit))
            for name, limit in (("mt-bench", args.bench_mt_bench), ("humaneval", args.bench_humaneval))}
    return {name: ([first_turn(r["messages"]) for r in rs], [r["category"] for r in rs]) for name, rs in sets.items() if rs}


def bench_configs(heads: dict, full: bool) -> list:
    """The speculative configs the demo benches over its heads (kind -> head folder), in the bench's order;
    configs/demo/bench.yaml lists them for the default kinds."""
    from serving.spec_decode.config import SpeculativeConfig

    k = NUM_SPECULATIVE_TOKENS
    configs = [SpeculativeConfig(method="ngram", num_speculative_tokens=k), SpeculativeConfig(method="suffix")]
    configs += [SpeculativeConfig(method=kind, model=str(folder), num_speculative_tokens=k) for kind, folder in heads.items()]
    configs += [SpeculativeConfig(method=kind, model=str(folder), num_speculative_tokens=k, **TREE)
                for kind, folder in heads.items() if full or kind in TREE_KINDS]
    configs += [SpeculativeConfig(method=kind, model=str(folder), num_speculative_tokens=k,
                                  confidence_threshold=CONFIDENCE_THRESHOLD, prompt_lookup_first=True)
                for kind, folder in heads.items()]
    configs += [SpeculativeConfig(method=kind, model=str(folder), num_speculative_tokens=k,
                                  confidence_threshold=CONFIDENCE_THRESHOLD, suffix_first=True)
                for kind, folder in heads.items() if kind in SUFFIX_FIRST_KINDS]
    configs += [SpeculativeConfig(method=kind, model=str(folder), num_speculative_tokens=k, adaptive=True)
                for kind, folder in heads.items() if kind in ADAPTIVE_KINDS]
    if full:  # the adaptive policy beside the fixed settings, at every concurrency (docs/methods/adaptive.md)
        configs += [SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=True)]
        configs += [SpeculativeConfig(method=kind, model=str(folder), num_speculative_tokens=k, adaptive=True,
                                      confidence_threshold=CONFIDENCE_THRESHOLD, prompt_lookup_first=True)
                    for kind, folder in heads.items()]
    return configs


def bench(args, heads: dict) -> dict:
    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.bench.report import write_report
    from serving.bench.sweep import Setting, run_settings

    configs = bench_configs(heads, args.full)
    engine = Engine(EngineConfig(args.target, max_num_seqs=16, dtype=args.dtype, device=args.device))
    pairs = [(0.0, 1)] + ([(0.0, 4), (0.0, 16), (0.7, 1), (0.7, 4), (0.7, 16)] if args.full else [])
    prompt_sets = bench_prompts(args)
    # transformers' generate is timed alongside in the goal's setting only
    settings = [Setting(name, temperature, concurrency, "hf" if (temperature, concurrency) == (0.0, 1) else None)
                for name in prompt_sets for temperature, concurrency in pairs]
    out = Path(args.results) / ("full" if args.full else "")
    results = run_settings(engine, prompt_sets, settings, configs, args.bench_new_tokens, out=out)
    return {"results": results, "files": [str(path) for path in write_report(results, out, "demo-bench")]}


if __name__ == "__main__":
    main()
