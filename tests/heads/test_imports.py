"""heads/ is pure torch + safetensors: it imports neither serving, training nor lightning."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKER = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('serving', 'training', 'lightning', 'pytorch_lightning', 'transformers'):
            raise ImportError(f'heads must not import {name}')

sys.meta_path.insert(0, Blocker())
import heads, heads.checkpoint, heads.medusa, heads.eagle, heads.eagle3, heads.mtp, heads.target_parts
print('ok')
"""


def test_heads_import_without_serving_training_or_lightning():
    result = subprocess.run([sys.executable, "-c", BLOCKER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_heads_sources_name_no_other_package():
    for source in (ROOT / "heads").glob("*.py"):
        for line in source.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]):
                assert words[1].split(".")[0] not in ("serving", "training", "lightning"), f"{source.name}: {line}"
