"""One bench setting: plain decoding and each speculative config take turns on the same prompts in one run, with
transformers' `generate` as an optional baseline; every row's tokens/s, and for speculative rows tau, the acceptance
rate, rows verified per step, per-depth acceptance, speedup over plain decoding and whether greedy outputs are
identical to plain decoding's."""
from __future__ import annotations

import resource
import time

import torch

from serving.request import SamplingParams
from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.speculator import Speculator


def run_bench(engine, prompts, categories, configs, max_new_tokens, concurrency, temperature=0.0, seed=0,
              baseline=None, progress=False, structured_outputs=None, unconstrained_configs=None) -> dict:
    """Plain decoding, each speculative config and (baseline="hf") transformers' generate take turns on each group
    of `concurrency` prompts, the turn's first method one further each group, so that drift in the machine's speed
    hits every method alike. `progress` shows a bar over the prompts, each counted once every method has answered
    it. `structured_outputs` (serving.structured_output.StructuredOutputs or a dict of its fields) constrains every
    answer, plain decoding's too; `unconstrained_configs` (with structured_outputs) adds plain decoding and these
    configs on the same prompts without it to the same turns, rows under result["unconstrained"] (their speedup
    and identity against plain decoding without it)."""
    from tqdm.auto import tqdm

    def sampling(structured):
        return [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                               structured_outputs=structured) for i in range(len(prompts))]

    engine.scheduler.max_num_seqs = concurrency
    methods = [(None, sampling(structured_outputs)), *((config, sampling(structured_outputs)) for config in configs)]
    if unconstrained_configs is not None:
        free = sampling(None)
        methods += [(None, free), *((config, free) for config in unconstrained_configs)]
    # Each drafter is loaded once, before any timing (a bad head fails here), and warmed up.
    speculators = [Speculator(engine, config) if config else None for config, _ in methods]
    warm_up = engine.encode(prompts[0])[:32]
    for speculator in speculators:
        engine.use_speculator(speculator)
        engine.generate([warm_up], SamplingParams(max_tokens=4))
    seconds, outputs = [0.0] * len(methods), [[] for _ in methods]
    hf = HfGenerate(engine) if baseline == "hf" else None
    bar = tqdm(total=len(prompts), disable=not progress, unit="prompt",
               desc=f"plain + {len(methods) - 1} drafters" + (" + generate" if hf else ""))
    for first in range(0, len(prompts), concurrency):
        group = slice(first, first + concurrency)
        turn = first // concurrency % len(methods)
        for m in [*range(turn, len(methods)), *range(turn)]:
            engine.use_speculator(speculators[m])
            start = time.perf_counter()
            outputs[m] += engine.generate(prompts[group], methods[m][1][group])
            seconds[m] += time.perf_counter() - start
        if hf:
            hf.generate(prompts[group], max_new_tokens)
        bar.update(len(prompts[group]))
    bar.close()
    engine.use_speculator(None)
    num_constrained = len(configs) + 1
    rows = bench_rows([config for config, _ in methods[:num_constrained]], speculators[:num_constrained],
                      seconds[:num_constrained], outputs[:num_constrained], categories, temperature)
    params = methods[0][1]
    result = {"target": str(engine.folder), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "structured_outputs": params[0].structured_outputs.key if params[0].structured_outputs else None,
              "concurrency": concurrency, "temperature": temperature, "dtype": engine.config.dtype,
              "products": engine.products, "device": str(engine.device), "threads": torch.get_num_threads(), "rows": rows}
    if unconstrained_configs is not None:
        result["unconstrained"] = bench_rows([config for config, _ in methods[num_constrained:]],
                                             speculators[num_constrained:], seconds[num_constrained:],
                                             outputs[num_constrained:], categories, temperature)
    plain_outputs = outputs[0]
    if hf:
        hf_rate = hf.num_tokens / hf.seconds
        result["hf_tokens_per_s"] = hf_rate
        result["speed_vs_hf"] = rows[0]["tokens_per_s"] / hf_rate
        result["identical_to_hf"] = all(a.token_ids == b for a, b in zip(plain_outputs, hf.outputs)) if temperature == 0 else None
        for row in rows:
            row["speed_vs_hf"] = row["tokens_per_s"] / hf_rate
    result.update(bandwidth_floor(engine, rows[0]))
    result["peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def bench_rows(configs, speculators, seconds, outputs, categories, temperature) -> list[dict]:
    """One row per method; the first is plain decoding, the others' speedup and identity are against it."""
    rows, plain_outputs = [], outputs[0]
    for config, speculator, elapsed, method_outputs in zip(configs, speculators, seconds, outputs):
        num_tokens = sum(len(o.token_ids) for o in method_outputs)
        row = {"method": config.label() if config else "plain",
               "num_speculative_tokens": config.num_speculative_tokens if config else 0,
               "config": config.__dict__ if config else None,
               "tokens_per_s": num_tokens / elapsed, "num_tokens": num_tokens, "seconds": elapsed}
        if config is None:
            plain_rate = row["tokens_per_s"]
            row.update(tau=1.0, mean_acceptance_length=1.0, acceptance_rate=None, rows_per_step=1.0, per_position=[], speedup=1.0,
                       identical_to_plain=True)
        else:
            stats, per_category = AcceptanceStats(), {}
            for output, category in zip(method_outputs, categories):
                spec = output.metrics.get("spec")
                request_stats = AcceptanceStats.from_dict(spec) if spec else AcceptanceStats()
                stats.merge(request_stats)
                per_category.setdefault(category, AcceptanceStats()).merge(request_stats)
            summary = stats.to_dict()
            row.update(num_invalid_spec_tokens=summary["num_invalid_spec_tokens"],
                       num_grammar_draft_tokens=summary["num_grammar_draft_tokens"],
                       num_accepted_grammar_draft_tokens=summary["num_accepted_grammar_draft_tokens"])
            row.update(tau=summary["tau"], mean_acceptance_length=summary["mean_acceptance_length"],
                       acceptance_rate=summary["acceptance_rate"], rows_per_step=summary["rows_per_step"],
                       per_position=summary["per_position"],
                       speedup=row["tokens_per_s"] / plain_rate,
                       identical_to_plain=all(a.token_ids == b.token_ids for a, b in zip(method_outputs, plain_outputs)),
                       per_category={c: {"tau": s.tau, "acceptance_rate": s.acceptance_rate} for c, s in sorted(per_category.items())})
        if temperature > 0:
            row["identical_to_plain"] = None  # sampled outputs agree in law, not token by token
        if speculator is not None and speculator.policy:
            row["adaptive"] = speculator.policy.summary()
        if speculator is not None:
            row.update(speculator.drafter.summary())  # lookahead: its pool's hit rate
        rows.append(row)
    return rows


class HfGenerate:
    """transformers' generate on the engine's target, greedy, one static batch per call with left padding."""

    def __init__(self, engine):
        from transformers import AutoModelForCausalLM

        self.engine = engine
        self.model = AutoModelForCausalLM.from_pretrained(engine.folder, dtype=engine.config.torch_dtype)
        self.model = self.model.to(engine.device).eval()
        self.pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        self.seconds, self.num_tokens, self.outputs = 0.0, 0, []
        with torch.inference_mode():  # warm-up
            self.model.generate(torch.tensor([[self.pad, self.pad]], device=engine.device), max_new_tokens=2,
                                do_sample=False, pad_token_id=self.pad)

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens) -> None:
        encoded = [self.engine.encode(p) for p in prompts]
        eos = self.engine.model.config.eos_token_ids
        width = max(map(len, encoded))
        device = self.engine.device
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in encoded], device=device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad)
        out = out.cpu()  # waits for the device, so that the time is the work's
        self.seconds += time.perf_counter() - start
        for row in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            self.outputs.append(row[:cut])
            self.num_tokens += cut


def bandwidth_floor(engine, plain_row) -> dict:
    """Bytes of weights read per decode step over the measured bandwidth: the fastest a step can be. Two rates of a
    256 MB buffer on the same threads: a copy's (bytes read + written), as the floor was first stated, and reading
    alone (a sum), which is all a step does with its weights; on this project's 2-core machines reading alone ran at
    0.6-1.05x the copy's counted rate in the same minute."""
    read = [engine.model.layers, engine.model.norm, engine.model.packed_lm_head]  # of the embedding, one row per token
    tensors = {id(t): t for module in read for t in [*module.parameters(), *module.buffers()]}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # written first: pages never touched would all read as the one zero page, far faster than memory
    source = torch.empty(64 * 2**20, dtype=torch.float32, device=engine.device).fill_(1.0)
    target = torch.empty_like(source)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None

    def seconds(fn) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        return (time.perf_counter() - start) / 5

    copy = 2 * source.numel() * 4 / seconds(lambda: target.copy_(source))
    reading = source.numel() * 4 / seconds(source.sum)
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gbs": copy / 1e9, "step_floor_ms": weight_bytes / copy * 1e3,
            "read_bandwidth_gbs": reading / 1e9, "read_floor_ms": weight_bytes / reading * 1e3,
            "plain_step_ms": 1e3 / plain_row["tokens_per_s"] if plain_row["tokens_per_s"] else None}
