"""A bench over several settings (prompt set x temperature x concurrency), resumable per setting.

With an output folder, each setting's result (`serving.bench.run_bench`) is written to its own file in
`settings/` there as soon as the setting ends, named by the setting and a hash of the options that define its
result: the target, dtype, device and block size, the prompts, new tokens, seed, baseline, the speculative configs
and the contents of the files they name (heads, token maps). A rerun with the same options reuses every setting
that has a file and runs the rest; a file made with other options is never reused, and the rerun says what
changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from serving.bench.offline import run_bench
from serving.bench.report import to_markdown


@dataclass(frozen=True)
class Setting:
    prompts: str  # the prompt set's name
    temperature: float
    concurrency: int
    baseline: str | None = None  # "hf": transformers' generate timed alongside

    @property
    def name(self) -> str:
        return f"{self.prompts} T={self.temperature:g} c={self.concurrency}"

    @property
    def stem(self) -> str:
        return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.prompts)}-T{self.temperature:g}-c{self.concurrency}"


def run_settings(engine, prompt_sets: dict, settings: list[Setting], configs: list, max_new_tokens: int, seed: int = 0,
                 out: str | Path | None = None, structured_outputs=None) -> list[dict]:
    """prompt_sets: name -> (prompts, categories). Plain decoding and `configs` side by side (`run_bench`) in each
    setting in turn; returns the settings' results in order, each with its setting's `name` and `prompts`. With
    `out`, settings whose file in out/settings/ holds their result under the same options are not run again.
    `structured_outputs` constrains every answer (run_bench)."""
    folder = Path(out) / "settings" if out is not None else None
    results, paths, options = {}, {}, {}
    if folder:
        for setting in settings:
            options[setting] = setting_options(engine, prompt_sets[setting.prompts][0], setting, configs, max_new_tokens, seed)
            if structured_outputs is not None:
                options[setting]["structured_outputs"] = structured_outputs
            paths[setting] = folder / f"{setting.stem}-{digest(json.dumps(options[setting], sort_keys=True).encode())}.json"
            if paths[setting].exists():
                results[setting] = json.loads(paths[setting].read_text())["result"]
                continue
            for other in sorted(folder.glob(f"{setting.stem}-*.json")):
                print(f"not reusing {other}: made with {changes(json.loads(other.read_text())['options'], options[setting])}")
        if results:
            print(f"reusing {len(results)} settings from {folder}: {', '.join(s.name for s in results)}")
    for setting in settings:
        if setting in results:
            continue
        prompts, categories = prompt_sets[setting.prompts]
        print(f"\n==> bench {setting.name}: {len(prompts)} prompts x {max_new_tokens} tokens, plain + {len(configs)} "
              f"drafters" + (" + transformers' generate" if setting.baseline else ""), flush=True)
        start = time.perf_counter()
        result = run_bench(engine, prompts, categories, configs, max_new_tokens, setting.concurrency, setting.temperature,
                           seed, baseline=setting.baseline, progress=True, structured_outputs=structured_outputs)
        result.update(name=setting.name, prompts=setting.prompts)
        print(f"{to_markdown(result)}\ntook {time.perf_counter() - start:.0f} s")
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
            partial = paths[setting].with_suffix(".tmp")  # a kill mid-write leaves no file that looks finished
            partial.write_text(json.dumps({"setting": asdict(setting), "options": options[setting], "result": result}, indent=1))
            os.replace(partial, paths[setting])
        results[setting] = result
    return [results[setting] for setting in settings]


def setting_options(engine, prompts: list, setting: Setting, configs: list, max_new_tokens: int, seed: int) -> dict:
    """What a setting's result depends on besides the setting itself."""
    files = [path for config in configs for path in (config.model, config.token_map) if path and Path(path).exists()]
    return {"target": str(engine.folder), "dtype": str(engine.dtype), "products": engine.products, "device": str(engine.device),
            "block_size": engine.block_size, "num_prompts": len(prompts), "prompts_digest": digest(json.dumps(prompts).encode()),
            "max_new_tokens": max_new_tokens, "seed": seed, "baseline": setting.baseline,
            "methods": [config.__dict__ for config in configs], "files": {path: digest_files(Path(path)) for path in files}}


def changes(old: dict, new: dict) -> str:
    """What differs, in words: 'max_new_tokens 64 (now 96), methods changed'."""
    keys = [key for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
    return "other options: " + ", ".join(
        f"{key} changed" if isinstance(new.get(key), (list, dict)) else f"{key} {old.get(key)!r} (now {new.get(key)!r})"
        for key in keys)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def digest_files(path: Path) -> str:
    """A file's or a folder's contents, names included."""
    sha = hashlib.sha256()
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file():
            sha.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
    return sha.hexdigest()[:12]
