"""What a step costs on this device, measured, never entered by hand: the adaptive policy's price list.

`StepCost`: seconds of one target forward as a function of the rows it computes and the sequences they belong to,
`f(rows) + per_seq * (seqs - 1)`, with f piecewise linear through times measured at engine start over the rows of
one sequence (a draft tree; the linear layers, which dominate, cost the same for any shape of the same rows; past
LONG_ROWS a prefill chunk, which is what steps of that many rows are, with one row of logits) and per_seq fitted on one row for each of several sequences (the extra attention and bookkeeping a sequence brings).
Each time is the fastest of a few interleaved repeats, and no more than any larger step's: another process on the
same cores only ever slows a run.
The context is fixed at measurement (`context`): on the CPU attention over a few hundred tokens is a small part of
a step. Measuring takes a few seconds; the result is cached per machine, target, dtype, device and block size
(step_cost/ in the project's cache, `$DRAFTHEADS_CACHE`, default ~/.cache/draftheads), and a cache file that does not parse or was measured for
something else is measured anew with a warning.

`DraftCost`: seconds of one drafting call, `a + b * depth + c * nodes + d * rows caught up` (the deepest tree
drafted, the nodes drafted over the batch, and the rows a head with a pool of its own ran over first), fitted by least
squares over every call timed, starting with a short calibration run. A choice is priced without the last term:
those rows are owed whether or not the requests draft.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from serving import targets
from serving.attention import PagedAttention, PagedMetadata
from serving.spec.tree import path_to

log = logging.getLogger(__name__)

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # up to max_num_batched_tokens
# more rows than this are timed as what they are in the engine, a prefill chunk (causal, one row of logits), with
# fewer repeats: they vary less and take longer
LONG_ROWS, LONG_REPEATS = 128, 2
SEQS = (2, 4, 8, 16)
VERSION = 2


@dataclass
class StepCost:
    rows: list[int]  # measured rows of one step, ascending
    seconds: list[float]  # fastest seconds of a forward over that many rows of one sequence, of `repeats`
    per_seq: float  # seconds each further sequence adds
    context: int  # tokens each sequence had in the K/V cache while measured
    key: dict = field(default_factory=dict)  # what was measured: machine, target, dtype, device, block size
    measured_at: float = 0.0  # unix time

    def predict(self, num_rows: int, num_seqs: int = 1) -> float:
        """Seconds of a forward over `num_rows` rows of `num_seqs` sequences; linear between measured rows and past
        the last two."""
        rows, seconds = self.rows, self.seconds
        i = min(max(bisect.bisect_left(rows, num_rows), 1), len(rows) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (rows[i] - rows[i - 1])
        return seconds[i - 1] + slope * (num_rows - rows[i - 1]) + self.per_seq * max(num_seqs - 1, 0)

    def table(self) -> str:
        """The fitted table as Markdown, what `draftheads bench --cost-model` prints."""
        age = time.time() - self.measured_at
        lines = [f"step cost on {self.key.get('device')} ({self.key.get('machine')}), target {self.key.get('target')}, "
                 f"{self.key.get('dtype')}, context {self.context}, measured {age / 3600:.1f} h ago",
                 "", "| rows | ms | vs 1 row |", "|---|---|---|"]
        lines += [f"| {n} | {s * 1e3:.2f} | {s / self.seconds[0]:.2f}x |" for n, s in zip(self.rows, self.seconds)]
        lines.append(f"\neach further sequence in the step: +{self.per_seq * 1e3:.3f} ms")
        return "\n".join(lines)


def cache_key(engine) -> dict:
    device = engine.device
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{_cpu_name()} x{torch.get_num_threads()} threads")
    return {"version": VERSION, "machine": machine, "target": engine.fingerprint["id"], "folder": str(engine.folder),
            "dtype": str(engine.dtype).removeprefix("torch."), "device": str(device), "block_size": engine.block_size,
            "torch": torch.__version__}


def load_or_measure(engine, remeasure: bool = False) -> StepCost:
    """The engine's step cost from the cache, or measured (and cached) when missing, unreadable, foreign or asked."""
    key = cache_key(engine)
    path = cache_dir() / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
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


def cache_dir() -> Path:
    return targets.cache_dir() / "step_cost"


@torch.inference_mode()
def measure(engine, repeats: int = 5) -> StepCost:
    """Times the engine's model over the K/V pool's blocks while no request holds them (the engine is idle): one
    sequence with a tree of rows - 1 nodes (or a chunk of that many rows past LONG_ROWS) for each of ROWS, and one row for each of SEQS sequences, interleaved so
    that drift hits every size alike."""
    assert not engine.has_unfinished(), "the step cost is measured while the engine is idle"
    size = engine.block_size
    pool = engine.cache.num_blocks * size
    most = min(engine.scheduler.max_num_batched_tokens, pool // 2, engine.max_model_len // 2)
    rows = [n for n in ROWS if n <= max(2, most)]  # two at least, to draw a line
    context = max(1, min(256, engine.max_model_len - max(rows) - 1, pool - max(rows) - 1))
    table = list(range(-(-(context + max(rows)) // size)))
    seqs = [s for s in SEQS if s <= engine.scheduler.max_num_seqs]
    device, model = engine.device, engine.model
    ids = torch.randint(0, model.config.vocab_size, (context + max(max(rows), max(seqs, default=1)),), device=device)
    model(ids[:context], torch.arange(context, device=device),
          PagedAttention(engine.cache, PagedMetadata.build([context], [context], [table], size, device)))

    def tree_step(num_rows: int) -> float:
        slot = lambda node: context + 1 + node  # the table is the identity; nodes hang off node i // 4 - 1
        parents = [i // 4 - 1 for i in range(num_rows - 1)]
        paths = [[slot(n) for n in path_to(parents, i)] for i in range(num_rows - 1)]
        meta = PagedMetadata.build([1], [context + 1], [table], size, device, [paths])
        depths = [len(p) for p in paths]
        positions = torch.tensor([context] + [context + d for d in depths], device=device)
        return _timed(lambda: model(ids[context:context + num_rows], positions, PagedAttention(engine.cache, meta),
                                    torch.arange(num_rows, device=device)), device)

    def chunk_step(num_rows: int) -> float:  # a prefill chunk: causal rows, the last one's logits
        meta = PagedMetadata.build([num_rows], [context + num_rows], [table], size, device)
        positions = torch.arange(context, context + num_rows, device=device)
        return _timed(lambda: model(ids[context:context + num_rows], positions, PagedAttention(engine.cache, meta),
                                    torch.tensor([num_rows - 1], device=device)), device)

    def seqs_step(num_seqs: int) -> float:  # every sequence reads the same context blocks: the cost is the same
        meta = PagedMetadata.build([1] * num_seqs, [context + 1] * num_seqs, [table] * num_seqs, size, device)
        positions = torch.full((num_seqs,), context, device=device)
        return _timed(lambda: model(ids[context:context + num_seqs], positions, PagedAttention(engine.cache, meta),
                                    torch.arange(num_seqs, device=device)), device)

    tree_step(max(rows)), tree_step(1)  # warm-up
    times = {("rows", n): [] for n in rows} | {("seqs", s): [] for s in seqs}
    for repeat in range(repeats):
        for kind, n in times:
            if kind == "seqs":
                times[kind, n].append(seqs_step(n))
            elif n <= LONG_ROWS:
                times[kind, n].append(tree_step(n))
            elif repeat < LONG_REPEATS:
                times[kind, n].append(chunk_step(n))
    seconds = [min(times["rows", n]) for n in rows]
    seconds = [min(seconds[i:]) for i in range(len(seconds))]  # more rows never cost less: a dip is noise
    cost = StepCost(rows, seconds, 0.0, context)
    extra = [(s - 1, min(times["seqs", s]) - cost.predict(s)) for s in seqs]
    if extra:  # least squares through the origin
        cost.per_seq = max(0.0, sum(x * y for x, y in extra) / sum(x * x for x, _ in extra))
    return cost


@dataclass
class DraftCost:
    """Least squares of a drafting call's seconds on [1, depth, nodes, rows caught up] over every timed call."""
    gram: np.ndarray = field(default_factory=lambda: np.eye(4) * 1e-9)
    moment: np.ndarray = field(default_factory=lambda: np.zeros(4))
    num_calls: int = 0
    _coef: tuple | None = None

    def add(self, depth: int, num_nodes: int, num_caught_up: int, seconds: float) -> None:
        x = np.array([1.0, depth, num_nodes, num_caught_up])
        self.gram += np.outer(x, x)
        self.moment += x * seconds
        self.num_calls += 1
        self._coef = None

    @property
    def coef(self) -> tuple[float, float, float, float]:
        if self._coef is None:  # as floats: predict runs for every candidate of every step
            self._coef = tuple(float(x) for x in np.maximum(np.linalg.lstsq(self.gram, self.moment, rcond=None)[0], 0.0))
        return self._coef

    def predict(self, depth: int, num_nodes: int) -> float:
        if depth == 0:
            return 0.0
        a, b, c, _ = self.coef
        return a + b * depth + c * num_nodes


def _timed(fn, device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
