"""`draftheads check HEAD`: does the head accept as well served as it did in training?

Per draft position i, the conditional acceptance (of the chains that reached position i, the share whose draft i the
target accepted), side by side:

- trained: `val/acc_i` that `draftheads fit` logged on held-out store examples and wrote into the head folder's
  config.json (metadata.training.metrics); absent for an imported head, or one never validated;
- engine: this project's engine drafting greedy chains of num_speculative_tokens with the head over the prompts;
- vllm: the real vLLM serving the head's vLLM export (`draftheads export --format vllm`) on the same prompts, when its
  CPU build is installed (`make vllm`) or `--vllm-endpoint` names a running server (started with that export and
  the same target, greedy).

It exits 1 when two columns disagree beyond their noise: the binomial standard error of the counts (z of them, 4 by
default). Engine and vLLM run the same greedy chains on the same prompts, so any gap beyond the noise is a
difference in how the head is read. Training scored other text (the store's held-out answers), so the engine only
fails against it when it accepts less than half as often, beyond the noise too.

Symptoms and their likely causes:

| symptom | likely cause |
|---|---|
| vLLM below the engine from position 1 | the export: aux layer order (`eagle_aux_hidden_state_layer_ids`), `norm_before_fc`, an fc bias vLLM drops, another target or rope setting served |
| vLLM agrees at position 1, falls behind later | the draft layer's own recurrence in vLLM: its rope (`rope_theta`, `rope_scaling` in the export), the token map (`d2t`) |
| engine below training from position 1 | the head reads other features than it trained on: aux layer ids in the head's config, a norm applied twice, a target changed since the store was generated; or prompts far from the training data (try `--prompts sharegpt-heldout`) |
| engine agrees at position 1, falls behind later | the draft layer's positions or rope in the engine against training's, a head trained with noise or teacher forcing the engine cannot give |
"""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("trained", "engine", "vllm")


@dataclass
class Column:
    """Per-position conditional acceptance: accepted[i] of reached[i] chains, or only rates where counts are not
    kept (the trained column)."""
    name: str
    rates: list[float]
    reached: list[int] | None = None

    def standard_error(self, i: int, rate: float) -> float:
        """The binomial standard error of position i's rate, were it `rate`; 0 without counts."""
        if self.reached is None:
            return 0.0
        n = max(self.reached[i], 1)
        return math.sqrt(max(rate * (1 - rate), 1.0 / n) / n)  # a rate of 0 or 1 still has a floor of 1 / n


@dataclass
class Finding:
    position: int  # 1-based
    served: Column
    reference: Column
    cause: str

    def __str__(self) -> str:
        i = self.position - 1
        return (f"position {self.position} accepts {self.served.rates[i]:.2f} in {self.served.name} vs "
                f"{self.reference.rates[i]:.2f} in {self.reference.name}: check {self.cause}")


def trained_column(config: dict, k: int) -> Column | None:
    """The fit's held-out val/acc_i from a head folder's config.json, or None where it kept none."""
    metrics = config.get("metadata", {}).get("training", {}).get("metrics", {})
    rates = [metrics.get(f"val/acc_{i}") for i in range(1, k + 1)]
    if any(rate is None for rate in rates):
        return None
    return Column("trained", [float(r) for r in rates])


def engine_column(engine, k: int, prompts: list, max_new_tokens: int) -> Column:
    """The engine (drafting with the head) over the prompts, greedy."""
    from serving.request import SamplingParams

    engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, ignore_eos=True))
    stats = engine.speculator.stats
    return Column("engine", [a / r if r else 0.0 for a, r in zip(stats.accepted[:k], stats.reached[:k])],
                  stats.reached[:k])


def vllm_counts(metrics_text: str, k: int) -> tuple[int, list[int]]:
    """(drafting steps, accepted tokens per position) from vLLM's /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    num_drafts, per_position = 0, {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:spec_decode_num_drafts_total":
                num_drafts += int(sample.value)
            if sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0) + int(sample.value)
    return num_drafts, [per_position.get(i, 0) for i in range(k)]


def vllm_column_from_counts(num_drafts: int, accepted: list[int]) -> Column:
    """vLLM drafts k tokens at every drafting step: position i is reached where i - 1 was accepted."""
    reached = [num_drafts] + accepted[:-1]
    return Column("vllm", [a / r if r else 0.0 for a, r in zip(accepted, reached)], reached)


def vllm_column(url: str, prompt_ids: list[list[int]], k: int, max_new_tokens: int) -> Column:
    import httpx

    def metrics():
        response = httpx.get(f"{url}/metrics", timeout=30)
        response.raise_for_status()
        return vllm_counts(response.text, k)

    models = httpx.get(f"{url}/v1/models", timeout=30)
    models.raise_for_status()
    model = models.json()["data"][0]["id"]
    before = metrics()
    for ids in prompt_ids:
        body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    after = metrics()
    return vllm_column_from_counts(after[0] - before[0], [a - b for a, b in zip(after[1], before[1])])


def served_vllm(target: str, head: Path, method: str, k: int, prompt_ids, max_new_tokens: int, timeout: float) -> Column:
    """Exports the head for vLLM into a temporary folder and serves it with `vllm serve`, stopped afterwards."""
    import heads
    from serving.bench.vllm_process import VllmServer
    from serving.targets import resolve
    from training import export as exporting

    loaded = heads.load(head)
    loaded.bind_target(heads.load_target_parts(resolve(target)))
    with tempfile.TemporaryDirectory(prefix="draftheads-check-") as folder:
        exported = exporting.export(loaded, "vllm", Path(folder) / "head")
        spec = {"method": method, "model": str(exported), "num_speculative_tokens": k}
        with VllmServer(resolve(target), spec, timeout=timeout) as server:
            return vllm_column(server.url, prompt_ids, k, max_new_tokens)


def compare(columns: dict[str, Column], z: float) -> list[Finding]:
    """The disagreements beyond the noise, each with its likely cause (the module's table)."""
    findings = []
    engine, trained, vllm = columns.get("engine"), columns.get("trained"), columns.get("vllm")
    first_off = {}
    for i in range(len(engine.rates)):
        if vllm is not None:
            a, b = vllm.rates[i], engine.rates[i]
            pooled = (a * max(vllm.reached[i], 1) + b * max(engine.reached[i], 1)) / (
                max(vllm.reached[i], 1) + max(engine.reached[i], 1))
            noise = math.hypot(vllm.standard_error(i, pooled), engine.standard_error(i, pooled))
            if abs(a - b) > z * noise and "vllm" not in first_off:
                first_off["vllm"] = i
                cause = ("the export: aux layer order / norm_before_fc / an fc bias vLLM drops / the target or its rope "
                         "setting served" if i == 0 else
                         "the draft layer's rope (rope_theta, rope_scaling) in the export / the token map (d2t)")
                findings.append(Finding(i + 1, vllm, engine, cause))
        if trained is not None:
            a, b = engine.rates[i], trained.rates[i]
            if a < b / 2 and b - a > z * engine.standard_error(i, b) and "engine" not in first_off:
                first_off["engine"] = i
                cause = ("the head's aux layer ids / a norm applied twice / the target since the store was generated "
                         "(or prompts far from the training data: try --prompts sharegpt-heldout)" if i == 0 else
                         "the draft positions or rope against training's / noise or teacher forcing in the fit")
                findings.append(Finding(i + 1, engine, trained, cause))
    return findings


def table(columns: dict[str, Column]) -> str:
    names = [n for n in COLUMNS if n in columns]
    lines = ["| position | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    k = len(columns["engine"].rates)
    for i in range(k):
        cells = []
        for name in names:
            column = columns[name]
            count = f" ({column.reached[i]})" if column.reached is not None else ""
            cells.append(f"{column.rates[i]:.3f}{count}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    from serving.targets import DEFAULT_TARGET

    parser.add_argument("head", help="a head folder: draftheads fit's heads/best or last, or draftheads import's output")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="the target the head drafts for (as bench takes)")
    parser.add_argument("--prompts", default="mt-bench", help="held-out prompts: a prompt source as bench takes")
    parser.add_argument("--num-prompts", type=int, default=8, help="first N prompts of the source (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="the chain's length (positions compared)")
    parser.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                        help="serve the head's export with vLLM's CPU build: auto where it is installed (make vllm)")
    parser.add_argument("--vllm-endpoint", default=None,
                        help="a running vLLM server (serving the head's vLLM export for --target, greedy) instead "
                             "of starting one")
    parser.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds vLLM may take to start")
    parser.add_argument("--z", type=float, default=4.0, help="standard errors that count as a disagreement")


def run(args) -> int:
    from serving.bench import vllm_process
    from serving.bench.prompts import first_turn, load_prompts
    from serving.config import EngineConfig
    from serving.engine import Engine

    head = Path(args.head)
    config_path = head / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{head} is not a head folder (no config.json): give draftheads fit's heads/best or "
                                "draftheads import's output")
    if args.num_prompts < 1 or args.max_new_tokens < 2 or args.num_speculative_tokens < 1:
        raise ValueError("--num-prompts, --num-speculative-tokens must be >= 1 and --max-new-tokens >= 2")
    config = json.loads(config_path.read_text())
    method, k = config["kind"], args.num_speculative_tokens
    messages = [first_turn(m) for m in load_prompts(args.prompts, args.num_prompts)["messages"]]

    columns: dict[str, Column] = {}
    trained = trained_column(config, k)
    if trained is not None:
        columns["trained"] = trained
    spec = {"method": method, "model": str(head), "num_speculative_tokens": k, "draft_weights": "float32"}
    engine = Engine(EngineConfig(args.target, speculative_config=spec))
    columns["engine"] = engine_column(engine, k, messages, args.max_new_tokens)
    use_vllm = args.vllm_endpoint is not None or args.vllm == "on" or (
        args.vllm == "auto" and vllm_process.missing_reason() is None)
    if use_vllm:
        prompt_ids = [engine.encode(m) for m in messages]
        if args.vllm_endpoint:
            columns["vllm"] = vllm_column(args.vllm_endpoint.rstrip("/"), prompt_ids, k, args.max_new_tokens)
        else:
            columns["vllm"] = served_vllm(args.target, head, method, k, prompt_ids, args.max_new_tokens,
                                          args.vllm_timeout)
    print(table(columns))
    notes = []
    if trained is None:
        notes.append("no trained column: the head folder keeps no val/acc_i (an imported head, or a fit without "
                     "validation)")
    if not use_vllm:
        notes.append(f"no vllm column: {vllm_process.missing_reason() or '--vllm off'}")
    for note in notes:
        print(f"note: {note}")
    findings = compare(columns, args.z)
    for finding in findings:
        print(f"MISMATCH: {finding}")
    if not findings:
        print("ok: the columns agree within their noise")
    return 1 if findings else 0
