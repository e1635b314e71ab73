"""The code blocks of README.md and docs/ that are marked runnable: an HTML comment line `<!-- runnable ... -->` right
before the fence. Python blocks run as written; bash blocks run with `draftheads` meaning this checkout's CLI, the
variables a test gives (MODEL), and each draftheads command's options followed by the test's small sizes, which
override the ones written (argparse and LightningCLI both keep an option's last value)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- runnable(?::\s*(?P<note>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w+)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not MARKER.match(line):
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise ValueError(f"{path}:{i + 1}: a runnable marker must be followed by a fenced block with its language")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        blocks.append(Block(path, i + 2, fence["lang"], "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


def commands(code: str) -> list[str]:
    """A bash block's commands, continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def with_sizes(command: str, sizes: dict[str, list[str]]) -> str:
    """`draftheads NAME ...` with sizes[NAME] appended (before a trailing comment)."""
    match = re.match(r"\s*draftheads\s+([\w-]+)", command)
    if not match or match[1] not in sizes:
        return command
    body, hash_, comment = command.partition("  #")
    return " ".join([body.rstrip(), *sizes[match[1]]]) + (f"  #{comment}" if hash_ else "")
