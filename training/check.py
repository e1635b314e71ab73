"""`draftheads check HEAD`: does the head accept as well served as it did in training?

Per draft position i, the conditional acceptance (of the chains that reached position i, the share whose draft i the
target accepted), side by side:

- trained: `val/acc_i` that `draftheads fit` logged on held-out store examples and wrote into the head folder's
  config.json (metadata.training.metrics); absent for an imported head, or one never validated;
- engine: this project's engine drafting greedy chains of num_speculative_tokens with the head over the prompts;
- vllm: the real vLLM serving the head's export on the same prompts: the check exports the head as vLLM serves its
  kind (--format vllm; speculators for P-EAGLE and DFlash) and starts vLLM's CPU build (`make vllm`), or serves
  `--vllm-export` (an export already made), or reads `--vllm-endpoint`, a running server (started with the export
  and the same target, greedy; `--vllm-export` names the export it serves, found without it when vLLM serves a
  speculators export as its model).

It exits 1 when two columns disagree beyond their noise: the binomial standard error of the counts (z of them, 4 by
default). Engine and vLLM run the same greedy chains on the same prompts, so any gap beyond the noise is a
difference in how the head is read. Training scored other text (the store's held-out answers), so the engine only
fails against it when it accepts less than half as often, beyond the noise too: at position 1 against training's
rate, at later positions against training's scaled by position 1's shortfall (the prompts' distance from the
training data, which lowers every position: the demo's EAGLE-3 head on MT-bench accepts 0.24 at position 1 for
training's 0.36, 0.20 at position 2 for 0.40). It exits 1 too where vLLM cannot
serve the head (its export refused, or vLLM refusing to start on it).

A gap's cause is then looked for (training/check_causes.py) and named where found: vLLM below the engine, in the
export vLLM serves read as vLLM reads it against the head and the targets (fc's blocks against vLLM's ascending
capture of the aux layers, a tensor vLLM's model has no parameter for such as an fc bias, the layer's settings and
weights, the rope of the export and of the target vLLM serves); the engine below training, in the head folder's
settings against those its fit recorded and its rope against the target's. Where none is found, the symptom names
the likely ones:

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
from dataclasses import dataclass, field
from pathlib import Path

from heads.hf_folder import read_config

COLUMNS = ("trained", "engine", "vllm")
# the format vLLM serves each kind from (P-EAGLE and DFlash from speculators'); DSpark's method needs GPUs (Triton)
# in vLLM and MTP modules are read from DeepSeek-V3 checkpoints only: neither has a vllm column here
VLLM_FORMATS = {"eagle": "vllm", "eagle3": "vllm", "medusa": "vllm", "peagle": "speculators", "dflash": "speculators"}
MAX_MODEL_LEN = 2048


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
    cause: str  # the likely causes by where the gap starts (the module's table)
    found: list[str] = field(default_factory=list)  # causes found in the head, its export, the targets (check_causes)

    def __str__(self) -> str:
        i = self.position - 1
        gap = (f"position {self.position} accepts {self.served.rates[i]:.2f} in {self.served.name} vs "
               f"{self.reference.rates[i]:.2f} in {self.reference.name}")
        if self.found:
            return f"{gap}: found " + "; ".join(self.found)
        return f"{gap}: check {self.cause}"


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


def served_model(url: str) -> tuple[str, str | None]:
    """(the model's name, the folder or hub id it was started with: /v1/models' root) of a running vLLM server."""
    import httpx

    models = httpx.get(f"{url}/v1/models", timeout=30)
    models.raise_for_status()
    model = models.json()["data"][0]
    return model["id"], model.get("root")


def vllm_column(url: str, prompt_ids: list[list[int]], k: int, max_new_tokens: int) -> Column:
    import httpx

    def metrics():
        response = httpx.get(f"{url}/metrics", timeout=30)
        response.raise_for_status()
        return vllm_counts(response.text, k)

    model, _ = served_model(url)
    before = metrics()
    for ids in prompt_ids:
        body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    after = metrics()
    return vllm_column_from_counts(after[0] - before[0], [a - b for a, b in zip(after[1], before[1])])


@dataclass
class Served:
    """What vLLM serves: the export (a folder; None where unknown) over the target (a folder; None where unknown)."""
    export: Path | None
    target: Path | None


def is_speculators(export: Path) -> bool:
    """A speculators-format export, which vLLM serves as its model (its verifier the target)."""
    return "speculators_model_type" in read_config(export)


def verifier(export: Path) -> Path | None:
    name = read_config(export)["speculators_config"]["verifier"]["name_or_path"]
    return Path(name) if (Path(name) / "config.json").is_file() else None


def bound_head(folder: Path, target: Path):
    """The head in `folder` bound to the target (to the rows of its token map where it drafts among one), as export
    reads it."""
    import heads
    from heads.token_map import lm_head_rows

    head = heads.load(folder)
    parts = heads.load_target_parts(target)
    if head.token_map is not None:
        parts.lm_head = lm_head_rows(parts.lm_head, head.token_map)
    return head.bind_target(parts)


def export_head(head, target: Path, k: int, out: Path) -> Path:
    """The head (loaded) exported as vLLM serves its kind (VLLM_FORMATS), bound to the target."""
    from training import export as exporting

    kind = head.config.kind
    return exporting.export(head, VLLM_FORMATS[kind], out, verifier=target, num_speculative_tokens=k)


def start_vllm(target: Path, export: Path, method: str, k: int, timeout: float):
    """`vllm serve` of the export: the speculators format as its model (the target its verifier), else the target
    with the export as its draft model."""
    from serving.bench.vllm_process import VllmServer

    if is_speculators(export):
        return VllmServer(export, None, max_model_len=MAX_MODEL_LEN, timeout=timeout)
    spec = {"method": method, "model": str(export), "num_speculative_tokens": k}
    return VllmServer(target, spec, max_model_len=MAX_MODEL_LEN, timeout=timeout)


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
            # training scored other text: position 1's shortfall measures how far the prompts are from training's
            # (a head fine on them accepts more than half as often there), and later positions are judged against
            # training's scaled by it, so that only a position falling behind on its own counts
            shift = 1.0 if i == 0 or not trained.rates[0] else min(1.0, engine.rates[0] / trained.rates[0])
            a, b = engine.rates[i], trained.rates[i] * shift
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
                        help="a running vLLM server (serving the head's export for --target, greedy) instead of "
                             "starting one")
    parser.add_argument("--vllm-export", default=None,
                        help="the export vLLM serves (the folder --vllm-endpoint's server was given; a speculators "
                             "export it serves as its model is found without it), or one to serve instead of "
                             "exporting the head: read against the head to name the cause of a gap")
    parser.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds vLLM may take to start")
    parser.add_argument("--z", type=float, default=4.0, help="standard errors that count as a disagreement")


def run(args) -> int:
    from serving.bench import vllm_process
    from serving.bench.prompts import first_turn, load_prompts
    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.targets import resolve
    from training import check_causes

    head = Path(args.head)
    config_path = head / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{head} is not a head folder (no config.json): give draftheads fit's heads/best or "
                                "draftheads import's output")
    if args.num_prompts < 1 or args.max_new_tokens < 2 or args.num_speculative_tokens < 1:
        raise ValueError("--num-prompts, --num-speculative-tokens must be >= 1 and --max-new-tokens >= 2")
    if args.vllm_export is not None and not (Path(args.vllm_export) / "config.json").is_file():
        raise FileNotFoundError(f"--vllm-export {args.vllm_export} is no export folder (no config.json): give the "
                                "folder `draftheads export` wrote and vLLM serves")
    config = json.loads(config_path.read_text())
    method, k = config["kind"], args.num_speculative_tokens
    target = Path(resolve(args.target))
    messages = [first_turn(m) for m in load_prompts(args.prompts, args.num_prompts)["messages"]]

    columns: dict[str, Column] = {}
    trained = trained_column(config, k)
    if trained is not None:
        columns["trained"] = trained
    spec = {"method": method, "model": str(head), "num_speculative_tokens": k, "draft_weights": "float32"}
    engine = Engine(EngineConfig(str(target), speculative_config=spec))
    columns["engine"] = engine_column(engine, k, messages, args.max_new_tokens)
    notes, problems = [], []
    if trained is None:
        notes.append("no trained column: the head folder keeps no val/acc_i (an imported head, or a fit without "
                     "validation)")
    use_vllm = args.vllm_endpoint is not None or args.vllm == "on" or (
        args.vllm == "auto" and vllm_process.missing_reason() is None)
    if use_vllm and args.vllm_endpoint is None and method not in VLLM_FORMATS:
        notes.append(f"no vllm column: vLLM's CPU build serves no {method} head here")
        use_vllm = False
    elif not use_vllm:
        notes.append(f"no vllm column: {'--vllm off' if args.vllm == 'off' else vllm_process.missing_reason()}")
    loaded = bound_head(head, target)
    served = Served(None, None)
    with tempfile.TemporaryDirectory(prefix="draftheads-check-") as folder:
        if use_vllm:
            prompt_ids = [engine.encode(m) for m in messages]
            if args.vllm_endpoint:
                url = args.vllm_endpoint.rstrip("/")
                _, root = served_model(url)
                served = served_by_endpoint(root, args.vllm_export)
                if served.export is None:
                    notes.append("the export vLLM serves is unknown: give it as --vllm-export to have a gap's cause "
                                 "named")
                columns["vllm"] = vllm_column(url, prompt_ids, k, args.max_new_tokens)
            else:
                try:
                    export = (Path(args.vllm_export) if args.vllm_export else
                              export_head(loaded, target, k, Path(folder) / "head"))
                except ValueError as error:  # a head vLLM cannot load as it is (e.g. EAGLE-1's fc bias)
                    problems.append(f"vLLM cannot serve this head: {error}")
                    export = None
                if export is not None:
                    served = Served(export, verifier(export) if is_speculators(export) else target)
                    try:
                        with start_vllm(target, export, method, k, args.vllm_timeout) as server:
                            columns["vllm"] = vllm_column(server.url, prompt_ids, k, args.max_new_tokens)
                    except RuntimeError as error:  # it refused the export or the target: say why, and what differs
                        found = check_causes.export_causes(loaded, export, target, served.target)
                        problems.append(f"vLLM did not serve {export}" + (
                            f": found {'; '.join(found)}" if found else f": {str(error)[-2000:]}"))
        print(table(columns))
        for note in notes:
            print(f"note: {note}")
        findings = compare(columns, args.z)
        for finding in findings:
            if finding.served.name == "vllm" and served.export is not None:
                finding.found = check_causes.export_causes(loaded, served.export, target, served.target)
            elif finding.served.name == "vllm" and served.target is not None:
                finding.found = check_causes.target_causes(target, served.target)
            elif finding.served.name == "engine":
                finding.found = check_causes.head_causes(config, target)
            print(f"MISMATCH: {finding}")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if not findings and not problems:
        print("ok: the columns agree within their noise")
    return 1 if findings or problems else 0


def served_by_endpoint(root: str | None, export: str | None) -> Served:
    """What a running server serves, from its model's root (/v1/models): a speculators export is its own model
    (the target its verifier); otherwise the root is the target, and the export only known from --vllm-export."""
    folder = Path(root) if root and (Path(root) / "config.json").is_file() else None
    if folder is not None and is_speculators(folder):
        return Served(Path(export) if export else folder, verifier(folder))
    return Served(Path(export) if export else None, folder)
