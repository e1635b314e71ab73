"""Fixtures the training tests share: the debug target's store, built once a session, and a folder of the test's own
to run in (the configs write under runs/; a module that needs it everywhere marks itself with usefixtures)."""
from __future__ import annotations

import pytest

from test_fit import session_store


@pytest.fixture(scope="session")
def debug_store(tmp_path_factory):
    return session_store(tmp_path_factory, "debug")


@pytest.fixture
def in_tmp_path(monkeypatch, tmp_path):
    """Runs write their relative paths (runs/...) under tmp_path."""
    monkeypatch.chdir(tmp_path)
