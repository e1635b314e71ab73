"""What a step costs on this device, measured, never entered by hand: the adaptive policy's price list.

`StepCost`: seconds of one target forward as a function of the rows it computes, the rows among them whose logits
it computes and the sequences they belong to, `f(rows) + per_logits_row * (logits rows - 1) + per_seq * (seqs - 1)`,
with f piecewise linear through times measured at engine start over the rows of one sequence with one row of logits
(a draft tree, less its further logits rows: the linear layers, which dominate, cost the same for any shape of the
same rows; past LONG_ROWS a prefill chunk, which is what steps of that many rows are), per_logits_row the difference
between a chunk with logits on every row and one with a single row of logits (the vocabulary projection, which a
verify row pays and a prefill row does not), and per_seq fitted on one row for each of several sequences (the
extra attention and bookkeeping a sequence brings). A verify step computes logits on every row, a prefill chunk on its last row at most.
Each time is the fastest of a few interleaved repeats, and no more than any larger step's: another process on the
same cores only ever slows a run.
The context is fixed at measurement (`context`): on the CPU attention over a few hundred tokens is a small part of
a step. Measuring takes a few seconds; the result is cached per machine, target, dtype, device, block size and kernels build
(step_cost/ in the project's cache, `$DRAFTHEADS_CACHE`, default ~/.cache/draftheads), and a cache file that does not parse or was measured for
something else is measured anew with a warning.

`DraftCost`: seconds of one drafting call, `a + b * depth + c * nodes` (the deepest tree drafted and the nodes
drafted over the batch), and of a head's catch-up call before it, `e + f * rows`, each fitted by least squares with
non-negative coefficients over every call timed, starting with a short calibration run. A choice is priced at the
drafting call plus `e`, not the rows a head catches up: a request pays those once, for every step since it last
drafted, and charging them to the step that drafts would keep a request that has not drafted for long from drafting
again.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from serving import kernels
from serving.cache_dir import cache_dir
from serving.cpu_features import cpu_features
from serving.spec_decode.tree import path_to

log = logging.getLogger(__name__)

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # up to max_num_batched_tokens
# more rows than this are timed as what they are in the engine, a prefill chunk (causal, one row of logits), with
# fewer repeats: they vary less and take longer
LONG_ROWS, LONG_REPEATS = 128, 2
SEQS = (2, 4, 8, 16)
LOGITS_ROWS = 64  # rows of the two chunks whose difference is the logits' cost
VERSION = 4  # 4: the target's layers as KernelLayers, one-row products two panels at a time


@dataclass
class StepCost:
    rows: list[int]  # measured rows of one step, ascending
    seconds: list[float]  # fastest seconds of a forward over that many rows of one sequence, one row of logits
    per_seq: float  # seconds each further sequence adds
    context: int  # tokens each sequence had in the K/V cache while measured
    key: dict = field(default_factory=dict)  # what was measured: machine, target, dtype, device, block size
    measured_at: float = 0.0  # unix time
    per_logits_row: float = 0.0  # seconds each further row of logits adds

    def predict(self, num_rows: int, num_seqs: int = 1, num_logits_rows: int | None = None) -> float:
        """Seconds of a forward over `num_rows` rows of `num_seqs` sequences, `num_logits_rows` of them with logits
        (default: every row, a verify step); linear between measured rows and past the last two."""
        rows, seconds = self.rows, self.seconds  # in plain Python: several calls a step, each a few microseconds
        i = min(max(bisect.bisect_left(rows, num_rows), 1), len(rows) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (rows[i] - rows[i - 1])
        logits = num_rows if num_logits_rows is None else num_logits_rows
        return (seconds[i - 1] + slope * (num_rows - rows[i - 1]) + self.per_logits_row * max(logits - 1, 0)
                + self.per_seq * max(num_seqs - 1, 0))

    def table(self) -> str:
        """The fitted table as Markdown, what `draftheads bench --cost-model` prints."""
        age = time.time() - self.measured_at
        lines = [f"step cost on {self.key.get('device')} ({self.key.get('machine')}), target {self.key.get('target')}, "
                 f"{self.key.get('dtype')}, context {self.context}, measured {age / 3600:.1f} h ago",
                 "", "| rows | ms, one row of logits | ms, logits on every row | vs 1 row |", "|---|---|---|---|"]
        lines += [f"| {n} | {s * 1e3:.2f} | {self.predict(n) * 1e3:.2f} | {self.predict(n) / self.seconds[0]:.2f}x |"
                  for n, s in zip(self.rows, self.seconds)]
        lines.append(f"\neach further row of logits: +{self.per_logits_row * 1e3:.3f} ms; "
                     f"each further sequence in the step: +{self.per_seq * 1e3:.3f} ms")
        return "\n".join(lines)


def cache_key(engine) -> dict:
    device = engine.device
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{cpu_features().model} x{torch.get_num_threads()} threads")
    return {"version": VERSION, "machine": machine, "target": engine.fingerprint["id"], "folder": str(engine.folder),
            "dtype": engine.config.dtype, "weights": engine.config.weights, "device": str(device),
            "products": engine.products,
            "block_size": engine.block_size,
            "torch": torch.__version__, "kernels": kernels.build_id() if device.type == "cpu" else None}


def load_or_measure(engine, remeasure: bool = False) -> StepCost:
    """The engine's step cost from the cache, or measured (and cached) when missing, unreadable, foreign or asked."""
    key = cache_key(engine)
    path = step_cost_dir() / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    if path.exists() and not remeasure:
        try:
            cost = StepCost(**json.loads(path.read_text()))
            if cost.key != key:
                raise ValueError(f"it was measured for {cost.key}")
            if len(cost.rows) < 2 or len(cost.rows) != len(cost.seconds) or min(cost.seconds) <= 0:
                raise ValueError("its table is malformed")
            return cost
        except (ValueError, TypeError) as error:  # JSONDecodeError is a ValueError
            log.warning("step cost cache %s cannot be used (%s): measuring again", path, error)
    cost = measure(engine)
    cost.key, cost.measured_at = key, time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".tmp{os.getpid()}")
    scratch.write_text(json.dumps(asdict(cost), indent=1))
    os.replace(scratch, path)
    return cost


def step_cost_dir() -> Path:
    return cache_dir() / "step_cost"


@torch.inference_mode()
def measure(engine, repeats: int = 5) -> StepCost:
    """Times the engine's model over the K/V pool's blocks while no request holds them (the engine is idle): one
    sequence with a tree of rows - 1 nodes (or a chunk of that many rows past LONG_ROWS) for each of ROWS, a chunk
    of LOGITS_ROWS rows with one row of logits and with logits on every row, and one row for each of SEQS sequences,
    interleaved so that drift hits every size alike."""
    assert not engine.has_unfinished(), "the step cost is measured while the engine is idle"
    size = engine.block_size
    pool = min(cache.num_blocks for cache in engine.runner.caches) * size  # one table addresses every group's pool
    most = min(engine.scheduler.max_num_batched_tokens, pool // 2, engine.max_model_len // 2)
    rows = [n for n in ROWS if n <= max(2, most)]  # two at least, to draw a line
    context = max(1, min(256, engine.max_model_len - max(rows) - 1, pool - max(rows) - 1))
    table = list(range(-(-(context + max(rows)) // size)))
    seqs = [s for s in SEQS if s <= engine.scheduler.max_num_seqs]
    runner = engine.runner
    device, model = runner.device, runner.model
    attention = lambda meta: runner.attention([meta] * len(runner.caches))  # every group's pool through one table
    ids = torch.randint(0, model.config.vocab_size, (context + max(max(rows), max(seqs, default=1)),), device=device)
    model(ids[:context], torch.arange(context, device=device),
          attention(runner.metadata([context], [context], [table])))

    def tree_step(num_rows: int) -> float:
        slot = lambda node: context + 1 + node  # the table is the identity; nodes hang off node i // 4 - 1
        parents = [i // 4 - 1 for i in range(num_rows - 1)]
        paths = [[slot(n) for n in path_to(parents, i)] for i in range(num_rows - 1)]
        meta = runner.metadata([1], [context + 1], [table], [paths])
        depths = [len(p) for p in paths]
        positions = torch.tensor([context] + [context + d for d in depths], device=device)
        return _timed(lambda: model(ids[context:context + num_rows], positions, attention(meta),
                                    torch.arange(num_rows, device=device)), device)

    def chunk_step(num_rows: int, every_logits_row: bool = False) -> float:  # a prefill chunk: causal rows
        meta = runner.metadata([num_rows], [context + num_rows], [table])
        positions = torch.arange(context, context + num_rows, device=device)
        logits_rows = torch.arange(0 if every_logits_row else num_rows - 1, num_rows, device=device)
        return _timed(lambda: model(ids[context:context + num_rows], positions, attention(meta),
                                    logits_rows), device)

    def seqs_step(num_seqs: int) -> float:  # every sequence reads the same context blocks: the cost is the same
        meta = runner.metadata([1] * num_seqs, [context + 1] * num_seqs, [table] * num_seqs)
        positions = torch.full((num_seqs,), context, device=device)
        return _timed(lambda: model(ids[context:context + num_seqs], positions, attention(meta),
                                    torch.arange(num_seqs, device=device)), device)

    tree_step(max(rows)), tree_step(1)  # warm-up
    logits_rows = min(LOGITS_ROWS, max(rows))
    times = ({("rows", n): [] for n in rows} | {("seqs", s): [] for s in seqs}
             | {("logits", False): [], ("logits", True): []})
    for repeat in range(repeats):
        for kind, n in times:
            if kind == "seqs":
                times[kind, n].append(seqs_step(n))
            elif kind == "logits":
                times[kind, n].append(chunk_step(logits_rows, every_logits_row=n))
            elif n <= LONG_ROWS:
                times[kind, n].append(tree_step(n))
            elif repeat < LONG_REPEATS:
                times[kind, n].append(chunk_step(n))
    per_logits_row = max(0.0, (min(times["logits", True]) - min(times["logits", False])) / max(logits_rows - 1, 1))
    seconds = [min(times["rows", n]) - (per_logits_row * (n - 1) if n <= LONG_ROWS else 0.0) for n in rows]
    seconds = [min(seconds[i:]) for i in range(len(seconds))]  # more rows never cost less: a dip is noise
    cost = StepCost(rows, seconds, 0.0, context, per_logits_row=per_logits_row)
    extra = [(s - 1, min(times["seqs", s]) - cost.predict(s)) for s in seqs]
    if extra:  # least squares through the origin
        cost.per_seq = max(0.0, sum(x * y for x, y in extra) / sum(x * x for x, _ in extra))
    return cost


class LinearFit:
    """Least squares of seconds on given terms over every sample added, with coefficients >= 0 (each one a cost):
    the best of the unconstrained fits over every subset of the terms whose coefficients all come out >= 0, exact
    for the few terms used here. Clamping an unconstrained fit instead lets two near-collinear terms trade a large
    positive coefficient for a negative one that is then dropped."""

    REFIT_AFTER, REFIT_EVERY = 32, 16  # past this many samples, refit once this many more have come (each step adds one)

    def __init__(self, num_terms: int):
        # sums kept as Python floats: each step adds a sample, and numpy calls after the target's forward cost tens of
        # microseconds each (the caches hold the weights it streamed)
        self.gram = [[0.0] * num_terms for _ in range(num_terms)]
        self.moment = [0.0] * num_terms
        self.num_samples, self.num_new = 0, 0
        self._coef: tuple[float, ...] = (0.0,) * num_terms

    def add(self, terms, seconds: float) -> None:
        for i, x in enumerate(terms):
            self.moment[i] += x * seconds
            row = self.gram[i]
            for j, y in enumerate(terms):
                row[j] += x * y
        self.num_samples += 1
        self.num_new += 1

    @property
    def coef(self) -> tuple[float, ...]:
        if self.num_new and (self.num_samples < self.REFIT_AFTER or self.num_new >= self.REFIT_EVERY):
            self.num_new = 0  # as floats: the policy predicts for every candidate of every step
            gram, moment = np.array(self.gram), np.array(self.moment)
            n, best, best_loss = len(moment), np.zeros(len(moment)), 0.0
            for mask in range(1, 1 << n):
                active = [i for i in range(n) if mask >> i & 1]
                solution = np.linalg.lstsq(gram[np.ix_(active, active)], moment[active], rcond=None)[0]
                if (solution < 0).any():
                    continue
                coef = np.zeros(n)
                coef[active] = solution
                loss = coef @ gram @ coef - 2 * coef @ moment  # the squared error, less a constant
                if loss < best_loss:
                    best, best_loss = coef, loss
            self._coef = tuple(float(x) for x in best)
        return self._coef


class DraftCost:
    """A drafting step's seconds: the drafting call, `a + b * depth + c * nodes` (the deepest tree drafted, the nodes
    drafted over the batch), and a head's catch-up call before it, `e + f * rows` over the rows it ran. A choice is
    priced at the call plus `e`, not the catch-up's rows (the module's docstring says why)."""

    def __init__(self):
        self.call, self.catch_up = LinearFit(3), LinearFit(2)

    def add(self, depth: int, num_nodes: int, seconds: float) -> None:
        self.call.add((1.0, depth, num_nodes), seconds)

    def add_catch_up(self, num_rows: int, seconds: float) -> None:
        self.catch_up.add((1.0, num_rows), seconds)

    @property
    def num_calls(self) -> int:
        return self.call.num_samples

    @property
    def per_node(self) -> float:
        return self.call.coef[2]

    def predict(self, depth: int, num_nodes: int) -> float:
        """Seconds of a drafting step to `depth` over `num_nodes` nodes (0 for one that drafts nothing)."""
        if not depth:
            return 0.0
        a, b, c = self.call.coef
        return a + b * depth + c * num_nodes + self.catch_up.coef[0]

    def summary(self) -> dict:
        return {"call_ms": [x * 1e3 for x in self.call.coef], "catch_up_ms": [x * 1e3 for x in self.catch_up.coef]}


def _timed(fn, device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
