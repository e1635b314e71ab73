"""`draftheads bench-serve`: an online benchmark of any OpenAI-compatible server (`draftheads serve`, vLLM's,
SGLang's), as vLLM's `vllm bench serve` measures one.

After one short warm-up request, requests arrive on a seeded Poisson schedule at --request-rate (or all at once), at
most --max-concurrency in flight, each streamed over one kept-alive async HTTP client. Per request it times the
first content chunk (TTFT), the gaps between content chunks (ITL: a speculative server sends several tokens in one
chunk), the time per output token after the first (TPOT) and the whole request (E2E), and reports mean, median and
p99 of each with request and output-token throughput. Acceptance over the run is the difference of the server's
/metrics counters before and after (vLLM's `vllm:spec_decode_*`; this project's server also counts verify steps, so
tau reads as `draftheads bench` computes it; SGLang's `sglang:spec_accept_length` gauge where that is all there is).
`--compare-endpoint` measures a second server on the same prompts and schedule, after the first, and gives each
figure's ratio.

`serve_and_bench` starts `draftheads serve` plain and with a speculative config, measures both, and stops them.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from serving.config_file import CONFIG_HELP, add_options, merge_options

HELP = {
    "config": CONFIG_HELP,
    "endpoint": "the server's base URL (its OpenAI API under /v1, Prometheus metrics at /metrics)",
    "compare_endpoint": "a second server's base URL, measured after the first on the same prompts and arrival "
                        "schedule; the report gives first / second for each figure",
    "api": "chat (/v1/chat/completions, the server's chat template) or completions (/v1/completions, the prompt's "
           "first user turn as raw text)",
    "model": "the model name to ask for (default: the first one /v1/models lists)",
    "prompts": "prompt source: mt-bench, humaneval, sharegpt, sharegpt-heldout, or a JSONL file (first turns)",
    "num_prompts": "requests to send: the first N prompts of the source",
    "request_rate": "mean arrivals per second, Poisson (exponential gaps drawn from --seed); inf sends all at once",
    "max_concurrency": "most requests in flight; later arrivals wait for one to finish (default: no limit)",
    "max_new_tokens": "max_tokens of each request",
    "temperature": "sampling temperature of each request (0 is greedy)",
    "ignore_eos": "ask for exactly max_new_tokens tokens (vLLM's and SGLang's ignore_eos field)",
    "seed": "seed of the arrival schedule",
    "label": "name of the first server in the report",
    "compare_label": "name of the second server in the report",
    "request_timeout": "seconds a request may take before it counts as failed",
    "out": "folder for bench_serve.json, bench_serve.md and latency.png",
}
APIS = ("chat", "completions")
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class BenchServeConfig:
    endpoint: str = "http://127.0.0.1:8000"
    compare_endpoint: str | None = None
    api: str = "chat"
    model: str | None = None
    prompts: str = "mt-bench"
    num_prompts: int = 16
    request_rate: float = math.inf
    max_concurrency: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    label: str | None = None
    compare_label: str | None = None
    request_timeout: float = 600.0
    out: str | None = None

    def __post_init__(self):
        for name in ("num_prompts", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
        if self.max_concurrency is not None and (not isinstance(self.max_concurrency, int) or self.max_concurrency < 1):
            raise ValueError(f"max_concurrency={self.max_concurrency!r} is invalid: an integer >= 1, or unset for none")
        self.request_rate = float(self.request_rate)
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} is invalid: requests per second > 0, or inf")
        if self.api not in APIS:
            raise ValueError(f"api={self.api!r} is invalid: choose {' or '.join(APIS)}")
        for name in ("endpoint", "compare_endpoint"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{name}={url!r} is not a URL: give http://HOST:PORT")
            if url is not None:
                setattr(self, name, url.rstrip("/").removesuffix("/v1"))
        self.label = self.label or self.endpoint
        self.compare_label = self.compare_label or self.compare_endpoint


def add_arguments(parser) -> None:
    import argparse

    types = {"num_prompts": int, "max_new_tokens": int, "max_concurrency": int, "request_rate": float,
             "temperature": float, "seed": int, "request_timeout": float}
    valued = {name: text for name, text in HELP.items() if name != "ignore_eos"}  # a flag, added below
    add_options(parser, BenchServeConfig, valued, types, {
        "config": {"metavar": "FILE"}, "api": {"choices": APIS}, "out": {"metavar": "DIR"},
        "endpoint": {"metavar": "URL"}, "compare_endpoint": {"metavar": "URL"}, "request_rate": {"metavar": "R"}})
    parser.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=argparse.SUPPRESS,
                        help=HELP["ignore_eos"])


def run(args) -> None:
    config = BenchServeConfig(**merge_options(vars(args), [f.name for f in fields(BenchServeConfig)]))
    prompts = load_first_turns(config.prompts, config.num_prompts)
    schedule = arrival_times(len(prompts), config.request_rate, config.seed)
    runs = [measure(config.endpoint, prompts, schedule, config, config.label)]
    if config.compare_endpoint:
        runs.append(measure(config.compare_endpoint, prompts, schedule, config, config.compare_label))
    report = make_report(runs, config)
    print(to_markdown(report))
    if config.out:
        for path in write_report(report, config.out):
            print(f"wrote {path}")


# ---- the load --------------------------------------------------------------------------------------------


def load_first_turns(source: str, limit: int) -> list[list[dict]]:
    from serving.bench.prompts import first_turn, load_prompts

    return [first_turn(messages) for messages in load_prompts(source, limit)["messages"]]


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of `rate` per second (the first at
    0), or all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    draw = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += draw.expovariate(rate)
    return times


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # seconds from the run's start
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, from the request's start
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


def measure(endpoint: str, prompts: list, schedule: list[float], config: BenchServeConfig, label: str) -> dict:
    """One server's run: its model, the requests' results and latency summaries, and acceptance from /metrics."""
    return asyncio.run(_measure(endpoint, prompts, schedule, config, label))


async def _measure(endpoint, prompts, schedule, config, label) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=config.max_concurrency or len(prompts), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=endpoint, limits=limits, timeout=config.request_timeout) as client:
        model = config.model or await first_model(client)
        warm_up = await send(client, _replace(config, max_new_tokens=4, ignore_eos=True), model, prompts[0], 0.0)
        if not warm_up.ok:
            raise RuntimeError(f"{endpoint}: the first request failed: {warm_up.error}")
        before = await scrape(client)
        gate = asyncio.Semaphore(config.max_concurrency or len(prompts))
        start = time.perf_counter()

        async def one(prompt, at):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                return await send(client, config, model, prompt, start)

        results = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, schedule)))
        duration = time.perf_counter() - start
        after = await scrape(client)
    return summarize(label, endpoint, model, results, duration, acceptance(before, after))


def _replace(config: BenchServeConfig, **changes) -> BenchServeConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


async def first_model(client) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def send(client, config: BenchServeConfig, model: str, messages: list[dict], run_start: float) -> RequestResult:
    """One streamed request; content chunks are timed as they arrive."""
    body = {"model": model, "max_tokens": config.max_new_tokens, "temperature": config.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.api == "chat":
        path, body["messages"] = "/v1/chat/completions", messages
    else:
        path, body["prompt"] = "/v1/completions", next(m["content"] for m in messages if m["role"] == "user")
    result = RequestResult()
    start = time.perf_counter()
    result.start = start - run_start
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            num_chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                if any(_content(choice) for choice in chunk.get("choices") or []):
                    now = time.perf_counter() - start
                    result.ttft = now if result.ttft is None else result.ttft
                    result.chunk_times.append(now)
                    num_chunks += 1
            result.e2e = time.perf_counter() - start
            result.num_output_tokens = result.num_output_tokens or num_chunks  # a server that sends no usage
            result.ok = result.ttft is not None
            result.error = None if result.ok else "no content came back"
    except Exception as error:  # a failed request is counted and reported, not fatal to the run
        result.error = f"{type(error).__name__}: {error}"
    return result


def _content(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


# ---- the server's counters -------------------------------------------------------------------------------


async def scrape(client) -> dict:
    """Every sample of /metrics as {(name, labels minus model and engine ids): value}; {} without /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get("/metrics")
        response.raise_for_status()
    except Exception:
        return {}
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k not in ("model_name", "engine", "engine_type", "tp_rank", "dp_rank", "pp_rank")))
            samples[(sample.name, labels)] = samples.get((sample.name, labels), 0.0) + sample.value
    return samples


def acceptance(before: dict, after: dict) -> dict | None:
    """The run's speculative acceptance from counter differences (vLLM's names; tau from this project's verify-step
    counters when present), or SGLang's accept-length gauge after the run; None when the server reports neither."""
    def grown(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    if ("vllm:spec_decode_num_drafts_total", ()) in after:
        num_drafts = grown("vllm:spec_decode_num_drafts_total")
        num_draft_tokens = grown("vllm:spec_decode_num_draft_tokens_total")
        num_accepted = grown("vllm:spec_decode_num_accepted_tokens_total")
        positions = sorted(int(dict(labels)["position"]) for name, labels in after
                           if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        per_position = [grown("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))
                        for p in positions]
        summary = {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted,
                   "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else None,
                   "mean_acceptance_length": 1 + num_accepted / num_drafts if num_drafts else None,
                   "per_position_acceptance": [n / num_drafts if num_drafts else None for n in per_position],
                   "num_accepted_per_position": per_position}
        num_steps = grown("draftheads:spec_decode_num_verify_steps_total")
        if num_steps:
            summary["tau"] = grown("draftheads:spec_decode_num_emitted_tokens_total") / num_steps
        return summary
    if ("sglang:spec_accept_length", ()) in after:
        return {"mean_acceptance_length": after[("sglang:spec_accept_length", ())],
                "acceptance_rate": after.get(("sglang:spec_accept_rate", ()))}
    return None


# ---- the report ------------------------------------------------------------------------------------------


def summarize(label, endpoint, model, results: list[RequestResult], duration: float, accepted: dict | None) -> dict:
    done = [r for r in results if r.ok]
    values = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [gap for r in done for gap in r.itls], "e2e": [r.e2e for r in done]}
    num_output = sum(r.num_output_tokens for r in done)
    num_prompt = sum(r.num_prompt_tokens or 0 for r in done)
    errors = [r.error for r in results if not r.ok]
    return {
        "label": label, "endpoint": endpoint, "model": model, "num_requests": len(results),
        "num_completed": len(done), "num_failed": len(errors), "first_error": errors[0] if errors else None,
        "duration_s": duration, "num_prompt_tokens": num_prompt, "num_output_tokens": num_output,
        "request_throughput": len(done) / duration, "output_throughput": num_output / duration,
        "total_token_throughput": (num_prompt + num_output) / duration,
        "latency_ms": {name: _stats(v) for name, v in values.items()},
        "acceptance": accepted,
        "requests": [{"start_s": r.start, "ttft_s": r.ttft, "e2e_s": r.e2e, "tpot_s": r.tpot,
                      "num_output_tokens": r.num_output_tokens, "chunk_times_s": r.chunk_times, "error": r.error}
                     for r in results],
    }


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": 1e3 * statistics.fmean(ordered), "median": 1e3 * statistics.median(ordered), "p99": 1e3 * p99}


def make_report(runs: list[dict], config: BenchServeConfig) -> dict:
    report = {"prompts": config.prompts, "num_prompts": config.num_prompts, "api": config.api,
              "request_rate": config.request_rate, "max_concurrency": config.max_concurrency,
              "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
              "ignore_eos": config.ignore_eos, "seed": config.seed, "runs": runs}
    if len(runs) == 2:
        report["ratios"] = ratios(*runs)
    return report


def ratios(first: dict, second: dict) -> dict:
    """first / second for throughputs and each latency's median (a throughput ratio above 1 and a latency ratio
    below 1 both favour the first server)."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    out = {name: ratio(first[name], second[name]) for name in ("request_throughput", "output_throughput")}
    for name in LATENCIES:
        out[f"{name}_median"] = ratio(first["latency_ms"][name]["median"], second["latency_ms"][name]["median"])
    return out


def to_markdown(report: dict) -> str:
    rate = "inf" if math.isinf(report["request_rate"]) else f"{report['request_rate']:g}/s"
    lines = [f"{report['num_prompts']} {report['prompts']} prompts, {report['api']} API, "
             f"{report['max_new_tokens']} new tokens, temperature {report['temperature']}, request rate {rate} "
             f"(seed {report['seed']}), max concurrency {report['max_concurrency'] or 'unlimited'}", "",
             "| server | done | req/s | out tok/s | TTFT ms mean / median / p99 | TPOT ms | ITL ms | E2E ms | "
             "accept rate | tau | MAL |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        cells = [" / ".join("-" if v is None else f"{v:.1f}" for v in run["latency_ms"][name].values())
                 for name in LATENCIES]
        accepted = run["acceptance"] or {}
        rate_cell = _fmt(accepted.get("acceptance_rate"), ".2f")
        tau, mal = _fmt(accepted.get("tau"), ".2f"), _fmt(accepted.get("mean_acceptance_length"), ".2f")
        lines.append(f"| {run['label']} | {run['num_completed']}/{run['num_requests']} | "
                     f"{run['request_throughput']:.2f} | {run['output_throughput']:.1f} | {' | '.join(cells)} | "
                     f"{rate_cell} | {tau} | {mal} |")
    if "ratios" in report:
        r = report["ratios"]
        first, second = (run["label"] for run in report["runs"])
        lines += ["", f"{first} / {second}: output throughput {_fmt(r['output_throughput'], '.2f')}x, request "
                  f"throughput {_fmt(r['request_throughput'], '.2f')}x; median TTFT {_fmt(r['ttft_median'], '.2f')}x, "
                  f"TPOT {_fmt(r['tpot_median'], '.2f')}x, ITL {_fmt(r['itl_median'], '.2f')}x, E2E "
                  f"{_fmt(r['e2e_median'], '.2f')}x"]
    for run in report["runs"]:
        if run["num_failed"]:
            lines += ["", f"{run['label']}: {run['num_failed']} requests failed, the first with: {run['first_error']}"]
    lines += ["", "tau: tokens per verify step (this project's servers count them); MAL: vLLM's mean acceptance "
              "length, 1 + accepted / drafts (both servers; SGLang's accept length)"]
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_report(report: dict, folder) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "bench_serve.json", folder / "bench_serve.md", folder / "latency.png"]
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(to_markdown(report) + "\n")
    plot_latency(report, paths[2])
    return paths


def plot_latency(report: dict, path) -> None:
    """Each latency's distribution (empirical CDF) per server, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
              "e2e": "end-to-end latency"}
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for axis, name in zip(axes, LATENCIES):
        for run in report["runs"]:
            requests = [r for r in run["requests"] if r["error"] is None]
            if name == "itl":
                values = [b - a for r in requests for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]
            else:
                values = [r[f"{name}_s"] for r in requests if r[f"{name}_s"] is not None]
            values = sorted(1e3 * v for v in values)
            if values:
                axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=run["label"])
        axis.set(title=titles[name], xlabel="ms",
                 ylabel="fraction of requests" if name != "itl" else "fraction of gaps")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- servers started here --------------------------------------------------------------------------------


def wait_healthy(url: str, process: subprocess.Popen, deadline: float, name: str, log_tail) -> None:
    """Polls `url`/health until it answers 200. A server that exits first, or is still not healthy at `deadline`
    (time.monotonic()), is an error naming it, with the end of its log (`log_tail()`)."""
    import httpx

    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{name} at {url} did not answer /health in time:\n{log_tail()}")


class ServerProcess:
    """`draftheads serve` in a subprocess on 127.0.0.1 at a free port; its log is kept in `log`."""

    def __init__(self, options: list[str], startup_timeout: float = 600.0):
        command = [sys.executable, "-m", "training", "serve", "--host", "127.0.0.1", "--port", "0", *options]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.url = None
        deadline = time.monotonic() + startup_timeout
        for line in self.process.stderr:
            self.log.append(line)
            if line.startswith("draftheads serve:") and " on http://" in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop()
            raise RuntimeError("draftheads serve did not start:\n" + "".join(self.log[-30:]))
        self._reader = threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True)
        self._reader.start()
        try:
            wait_healthy(self.url, self.process, deadline, "draftheads serve", lambda: "".join(self.log[-30:]))
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()


def serve_and_bench(target: str, speculative_config, *, prompts: str = "mt-bench", num_prompts: int = 8,
                    max_new_tokens: int = 64, request_rate: float = 1.0, max_concurrency: int | None = None,
                    seed: int = 0, serve_options: list[str] = (), out=None, label: str | None = None) -> dict:
    """Starts `draftheads serve --target TARGET` twice on 127.0.0.1, with `speculative_config` (a mapping or its
    JSON text) and plain, measures each on the same prompts and Poisson schedule (greedy chat requests; the
    speculative one first, each with the other server idle), stops both and returns the report: its "runs" (the
    speculative one first) and "ratios" (speculative / plain: output_throughput is the online speedup). With
    `out` it also writes bench_serve.json, bench_serve.md and latency.png there. `serve_options` are more
    `draftheads serve` options for both (e.g. ["--max-num-seqs", "16"])."""
    spec_json = speculative_config if isinstance(speculative_config, str) else json.dumps(speculative_config)
    if label is None:
        from serving.spec_decode.config import SpeculativeConfig

        label = SpeculativeConfig.from_json(spec_json).label()
    config = BenchServeConfig(prompts=prompts, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                              request_rate=request_rate, max_concurrency=max_concurrency, seed=seed, label=label,
                              compare_label="plain")
    turns = load_first_turns(prompts, num_prompts)
    schedule = arrival_times(len(turns), config.request_rate, seed)
    base = ["--target", str(target), *serve_options]
    with ServerProcess([*base, "--speculative-config", spec_json]) as speculative, ServerProcess(base) as plain:
        runs = [measure(speculative.url, turns, schedule, config, label),
                measure(plain.url, turns, schedule, config, "plain")]
    report = make_report(runs, config)
    if out is not None:
        write_report(report, out)
    return report
