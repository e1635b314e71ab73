"""`python -m benchmarks TABLE`: every documented table has a command that names real options, and a run writes its
output stamped with the commit and the machine."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from benchmarks.__main__ import ROOT, TABLES, machine, main
from serving.spec_decode.config import SpeculativeConfig


def test_every_table_has_its_page_and_the_pages_list_every_table():
    index = (ROOT / "docs" / "benchmarks" / "index.md").read_text()
    for name, table in TABLES.items():
        assert (ROOT / "docs" / "benchmarks" / table.page).is_file(), name
        assert f"| `{name}` | [" in index, name
    assert set(re.findall(r"^\| `([\w-]+)` \| \[", index, re.MULTILINE)) == set(TABLES)


@pytest.mark.parametrize("name", TABLES)
def test_command_runs_a_module_with_valid_configs(name):
    command = TABLES[name].command
    assert command[0] == "-m" and importlib.util.find_spec(command[1]) is not None
    for flag, value in zip(command, command[1:]):
        if flag in ("--speculative-config", "--drafter"):
            SpeculativeConfig.from_json(value)  # raises on a bad config


def test_machine_names_the_cpu_and_its_kernel_flags():
    assert "cores, flags:" in machine()


@pytest.mark.e2e  # a bench run through python -m benchmarks
def test_a_table_run_is_stamped(tmp_path, capsys):
    assert main(["engine-vs-transformers", "--target", "debug", "--num-prompts", "1", "--max-new-tokens", "4"],
                out=tmp_path) == 0
    text = (tmp_path / "engine-vs-transformers.md").read_text()
    assert re.search(r"- commit: [0-9a-f]{7,}", text) and "- machine: " in text and "cores, flags:" in text
    assert "- command: `python -m training bench" in text and "--target debug" in text
    assert "| plain |" in text  # the bench's own table, captured
