"""Hidden states of teacher-forced examples (prompt + answer token ids), from one of three backends:

- `engine`: this project's paged engine, one prefill pass per example (the families serving.model loads);
- `transformers`: `AutoModelForCausalLM` of any family transformers loads, padded batches, on CPU or GPU;
- `vllm`: vLLM's `extract_hidden_states` speculative method, run by training.data.vllm_capture in vLLM's own
  Python (see there), for every family vLLM serves.

One layer convention for all three, the store's (training.data.store): "aux.{i}" is the input of decoder layer i
(Hugging Face's hidden_states[i], vLLM's aux hidden state layer id i; SGLang numbers them one lower) and "last" is
the output of the final norm, what the LM head reads. The backends compute in the store's target dtype and agree
within float32 rounding before the store rounds to bfloat16 (tests/training/test_capture.py states how far).

A backend takes examples with `add`, and `step` returns (example, {store key: [T, hidden]}) pairs as its passes
finish, T = len(example["input_ids"]).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Protocol

import torch

from serving.bench import vllm_process
from serving.engine import Engine
from serving.model import SUPPORTED_ARCHITECTURES
from serving.request import SamplingParams
from training.data.store import HIDDEN_DTYPE

CAPTURES = ("auto", "engine", "vllm", "transformers")


class Capture(Protocol):
    def add(self, example: dict) -> None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[tuple[dict, dict]]: ...
    def close(self) -> None: ...


def resolve_capture(name: str, architecture: str, vllm_python: str | None) -> str:
    """The backend `name` stands for: `auto` is the engine where it loads the family, else vLLM where its Python
    is found, else transformers."""
    if name not in CAPTURES:
        raise ValueError(f"capture={name!r} is invalid: choose one of {', '.join(CAPTURES)}")
    if name != "auto":
        if name == "engine" and architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"the engine does not run {architecture} (it runs {', '.join(SUPPORTED_ARCHITECTURES)}): "
                             "pass --capture transformers, or --capture vllm where vLLM is installed")
        return name
    if architecture in SUPPORTED_ARCHITECTURES:
        return "engine"
    return "vllm" if vllm_python is not None else "transformers"


def find_vllm_python(given: str | None) -> str | None:
    """The Python that runs vLLM: `given`, else this one where it imports vllm, else the one `vllm serve` runs
    with (serving.bench.vllm_process: $DRAFTHEADS_VLLM_PYTHON or `make vllm`'s .venv-vllm), else None."""
    if given is not None:
        if not Path(given).is_file():
            raise ValueError(f"--vllm-python {given} is no file: pass the python executable of an environment with "
                             "vLLM installed (e.g. .venv-vllm/bin/python after `make vllm`)")
        return given
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    found = vllm_process.executable()
    return str(found) if found.is_file() else None


class NoCapture:
    """Examples pass straight through, for stores of token ids only (`--layers none`)."""

    def __init__(self):
        self.done: list[tuple[dict, dict]] = []

    def add(self, example: dict) -> None:
        self.done.append((example, {}))

    def has_unfinished(self) -> bool:
        return bool(self.done)

    def step(self) -> list[tuple[dict, dict]]:
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        pass


class EngineCapture:
    """Each example a request whose prompt is all of its tokens, with max_tokens 1: the engine prefills it in
    chunks, batched with the other examples, then runs the one emitted token too, whose row is dropped."""

    def __init__(self, engine: Engine, keys: list[str]):
        self.engine, self.keys = engine, keys
        self.active: dict[str, dict] = {}  # request id (the example's id) -> example

    def add(self, example: dict) -> None:
        self.active[example["id"]] = example
        self.engine.add_request(example["input_ids"], SamplingParams(max_tokens=1, temperature=0.0),
                                request_id=example["id"])

    def has_unfinished(self) -> bool:
        return bool(self.active)

    def step(self) -> list[tuple[dict, dict]]:
        done = []
        for output in self.engine.step():
            example = self.active.pop(output.request_id)
            rows = slice(0, len(example["input_ids"]))
            captured = {"last": output.hidden[rows], **{f"aux.{i}": h[rows] for i, h in output.aux.items()}}
            done.append((example, {key: captured[key].to(HIDDEN_DTYPE) for key in self.keys}))
        return done

    def close(self) -> None:
        pass


class TransformersCapture:
    """One forward of the target's decoder (no LM head: a 262k-vocabulary head would cost more than the layers) over
    a right-padded batch of up to `max_batch_tokens` tokens; the aux layers' inputs are caught by forward pre-hooks
    on those layers, "last" is the decoder's output, after its final norm."""

    def __init__(self, folder: Path, keys: list[str], aux_layers: tuple[int, ...], *, dtype: torch.dtype,
                 device: str, max_batch_tokens: int):
        from transformers import AutoModelForCausalLM

        self.keys, self.device, self.max_batch_tokens = keys, device, max_batch_tokens
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        self.decoder = model.get_decoder().to(device).eval()
        del model  # the LM head is never run
        layers = self.decoder.layers
        self.caught: dict[int, torch.Tensor] = {}
        for i in dict.fromkeys(aux_layers):
            layers[i].register_forward_pre_hook(self._catcher(i), with_kwargs=True)
        self.queue: list[dict] = []

    def _catcher(self, layer: int):
        def catch(module, args, kwargs):
            self.caught[layer] = args[0] if args else kwargs["hidden_states"]
        return catch

    def add(self, example: dict) -> None:
        self.queue.append(example)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[tuple[dict, dict]]:
        batch, num_tokens = [], 0
        while self.queue and (not batch or num_tokens + len(self.queue[0]["input_ids"]) <= self.max_batch_tokens):
            example = self.queue.pop(0)
            batch.append(example)
            num_tokens += len(example["input_ids"])
        if not batch:
            return []
        lengths = [len(example["input_ids"]) for example in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, example in enumerate(batch):
            ids[row, :lengths[row]] = torch.tensor(example["input_ids"])
            mask[row, :lengths[row]] = 1
        with torch.inference_mode():
            output = self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        captured = {"last": output.last_hidden_state, **{f"aux.{i}": h for i, h in self.caught.items()}}
        self.caught = {}
        return [(example, {key: captured[key][row, :lengths[row]].to("cpu", HIDDEN_DTYPE) for key in self.keys})
                for row, example in enumerate(batch)]

    def close(self) -> None:
        pass
