"""The documentation: the site builds with --strict (no broken link or anchor), README stays short, and the text
speaks of the project only."""
from __future__ import annotations

import re
import subprocess
import sys

from runnable import ROOT, pages


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    home = (site / "index.html").read_text()
    assert "md-nav" in home and "Getting started" in home  # the navigation
    assert "train here" in home and "speculators format" in home  # the support matrix


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")
               if str(p.relative_to(ROOT / "docs")) not in nav]
    assert not missing


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_text_speaks_of_the_project_only():
    """No experiment log in the user's text ("round N") and no document outside the repository."""
    for page in pages():
        text = page.read_text()
        assert not re.search(r"\bround\b", text, re.IGNORECASE), page
    outside = "DESIGN" + ".md"  # a document outside the repository, spelled so that this file does not name it
    sources = [*pages(), ROOT / "Makefile", *(p for d in ("heads", "serving", "training", "benchmarks", "tests")
                                           for p in (ROOT / d).rglob("*.py"))]
    assert not [str(p) for p in sources if outside in p.read_text()]
