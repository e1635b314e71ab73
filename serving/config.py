"""Every engine option once: `EngineConfig`, validated once, and the help text each option has wherever a command
(serve, bench, generate) exposes it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from heads.config import is_positive_int
from serving import targets
from serving.spec_decode.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS = {"float32": torch.float32, "bfloat16": torch.bfloat16}

HELP = {
    "target": "target: a built-in name, a local Hugging Face folder or a hub id (see `draftheads info`)",
    "dtype": "weights and activations. bfloat16 on a CPU where the engine's kernels run: the linear layers and the LM "
             "head multiply bfloat16 weights by activations rounded to bfloat16, summed in float32 (on AVX512-BF16's "
             "dot products where the CPU has them), each row in one order whatever the batch, so speculative greedy "
             "outputs stay identical to plain decoding; the residual stream, norms, attention and logits stay float32. "
             "bfloat16 elsewhere (CUDA, or without the kernels) runs torch's operators, which are not batch-invariant: "
             "near-ties can flip between a decode and a verify step",
    "weights": "how the target's linear layers (and its LM head) store their weights with dtype float32: bfloat16 "
               "halves the bytes a step streams through the CPU kernels (rounded once at load; every product still runs and "
               "sums in float32, so speculative greedy outputs stay identical to plain decoding with the same weights; "
               "where the kernels do not run, the rounded weights run in float32)",
    "device": "where the target runs: auto (the first CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    "block_size": "K/V block size in tokens",
    "num_blocks": "K/V blocks in the pool, in each KV cache group's on a target with sliding windows (default: as many as "
                  "kv_cache_memory_gib holds)",
    "kv_cache_memory_gib": "memory for the K/V pool, GiB (at least one max_model_len request always fits)",
    "max_num_seqs": "most requests in the running batch; later ones wait",
    "max_num_batched_tokens": "tokens per engine step; longer prompts are prefilled in chunks",
    "max_model_len": "most tokens per request, prompt and completion (default: the target's maximum)",
    "enable_prefix_caching": "share the K/V of full blocks between requests with the same prefix",
    "num_threads": "torch (and kernel) threads of the engine (default: torch's, one per core)",
    "speculative_config": 'speculative decoding as JSON, vLLM\'s keys, e.g. \'{"method": "eagle3", '
                          '"model": "runs/eagle3/heads/best", "num_speculative_tokens": 4}\' (default: plain decoding)',
}
TYPES = {"block_size": int, "num_blocks": int, "kv_cache_memory_gib": float, "max_num_seqs": int,
         "max_num_batched_tokens": int, "max_model_len": int, "num_threads": int}


@dataclass
class EngineConfig:
    target: str = targets.DEFAULT_TARGET
    dtype: str = "float32"
    weights: str = "float32"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory_gib holds
    kv_cache_memory_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the target's max_position_embeddings
    enable_prefix_caching: bool = True
    # keep every computed row's final hidden state and the inputs of `aux_layers` (self-distillation)
    capture_hidden: bool = False
    aux_layers: tuple[int, ...] = ()
    speculative_config: SpeculativeConfig | None = None  # or its JSON text or mapping
    num_threads: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights={self.weights!r} is not supported; choose one of {', '.join(WEIGHTS)}")
        if self.weights != "float32" and self.dtype != "float32":
            raise ValueError(f"weights={self.weights!r} applies to a float32 target; with dtype={self.dtype!r} the "
                             "weights already have that dtype: leave weights at float32")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "num_threads"):
            value = getattr(self, name)
            if value is None and name in ("num_blocks", "num_threads"):
                continue
            if not is_positive_int(value):
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib={self.kv_cache_memory_gib} is invalid: it must be > 0")
        self.aux_layers = tuple(self.aux_layers)
        if isinstance(self.speculative_config, (str, dict)):
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)
        if self.speculative_config is not None and self.capture_hidden:
            raise ValueError("capture_hidden and speculative decoding cannot be combined: capture with plain decoding")
        resolve_device(self.device)  # a bad device fails before anything loads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> torch.dtype:
        return WEIGHTS[self.weights]


def resolve_device(device: str) -> torch.device:
    """'auto' is the first CUDA GPU when torch sees one, else the CPU; any other name is torch's ('cpu', 'cuda:1')."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device={device!r} is not a device: use auto, cpu, cuda or cuda:N ({error})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but this torch build sees no CUDA GPU (torch {torch.__version__}): "
                         "use device cpu, or install a CUDA build of torch")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the engine runs on cpu or cuda")
    return resolved
