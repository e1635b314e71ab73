"""The float32 CPU kernels of serving/kernels.c, and the inference versions of the decoder's linear layers, norms
and whole target layers (`KernelLayer`) that call them (serving/attention.py calls `paged_attention`).

At the 1-16 rows of a decode or verify step, the BLAS that ships with torch runs far from this CPU's memory
bandwidth, its time per step grows with every row added, and each small operator costs more in dispatch
than in arithmetic. `kernels.c` streams weights stored as column panels, keeps each output a single
in-order sum (a row's result is the same in any batch), normalises a row in one pass, and attends over paged
keys in place. It is compiled once per machine with the C compiler (`$CC`, default `cc`) into
$DRAFTHEADS_CACHE/kernels and runs on the OpenMP threads torch already uses. Without a compiler or AVX2, or with
DRAFTHEADS_KERNELS=torch, the same modules run torch's operators.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from heads.eagle3 import Eagle3
from heads.layer import DecoderLayer, RMSNorm
from serving.cache_dir import cache_dir
from serving.cpu_features import bf16_path
from serving.kernel_abi import (STRUCTS, AttentionArgs, Eagle3Args, FieldLayout, ForwardArgs, ForwardScratch, LayerStep,
                                LayerWeights)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
PANEL = 16  # NR in kernels.c
TILE_PAIRS = 16  # kernels.c's TILE_PAIRS: pairs of inputs in one AMX weight tile
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_long, _ptr, _float = ctypes.c_long, ctypes.c_void_p, ctypes.c_float
# The leaf kernels' argument lists; the calls that take more take one struct (serving/kernel_abi.py).
SIGNATURES = {
    "gemm_panels": [_ptr, _long, _long, _ptr, _long, _long, _ptr, _ptr, _long],
    "gemm_panels_bf16": [_ptr, _long, _long, _ptr, _long, _long, _ptr, _ptr, _long],
    "gemm_panels_i8": [_ptr, _long, _long, _ptr, _long, _long, _ptr, _ptr, _long],
    "gemm_pairs_bf16": [_ptr, _long, _long, _ptr, _long, _long, _ptr, _ptr, _long, _long],
    "rms_norm": [_ptr, _long, _long, _ptr, _float, _ptr, _long, _long],
    "argmax_rows": [_ptr, _long, _long, _long, _ptr],
    "top_log_probs": [_ptr, _long, _long, _long, _ptr, _long, _long, _ptr, _ptr],
    "paged_attention": [ctypes.POINTER(AttentionArgs)],
    "layer_pre": [ctypes.POINTER(LayerStep)],
    "layer_post": [ctypes.POINTER(LayerStep)],
    "model_forward": [ctypes.POINTER(ForwardArgs)],
    "eagle3_forward": [ctypes.POINTER(Eagle3Args)],
    "kernel_layouts": [ctypes.POINTER(ctypes.POINTER(FieldLayout))],
}
RESULT_TYPES = {"model_forward": _long, "eagle3_forward": _long, "kernel_layouts": _long}
# kernels.c's weight formats (layer_weights.format, forward_args.lm_format): float32, bfloat16 and int8 panels under
# float32 activations, and bfloat16 pair panels under bfloat16 activations on each product path (serving.cpu_features)
F32_PANELS, BF16_PANELS, I8_PANELS = 0, 1, 5
PAIR_PATHS = {"amx": 4, "avx512_bf16": 2, "widened": 3}


def build_id() -> str:
    """What computes the engine's steps on CPU: the compiled kernels' digest (of source, compiler and flags), or
    "torch"; costs measured under one do not hold under another (serving.spec_decode.cost keys its cache by it)."""
    lib = library()
    return "torch" if lib is None else Path(lib._name).stem


def product_path(weight_dtype: torch.dtype, compute: torch.dtype) -> str:
    """How PackedLinears of these dtypes multiply on this CPU, for bench headers."""
    if library() is None:
        return "torch operators"
    if compute == torch.bfloat16:
        return {"amx": "bfloat16 x bfloat16 on AMX tiles (tdpbf16ps), float32 sums",
                "avx512_bf16": "bfloat16 x bfloat16 on AVX512-BF16 dot products (vdpbf16ps), float32 sums",
                "widened": "bfloat16 x bfloat16 widened to float32 FMA tiles"}[bf16_path()]
    return f"float32 FMA tiles over {str(weight_dtype).removeprefix('torch.')} weights"


def compile_flags() -> list[str]:
    """The C compiler's flags for this CPU: AVX-512's 32 vector registers let a tile hold 12 rows (kernels.c, MR);
    the arithmetic stays 8 lanes wide."""
    return FLAGS + (["-mavx512f", "-mavx512vl"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when this machine cannot build or run them."""
    if os.environ.get("DRAFTHEADS_KERNELS", "c") == "torch":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("serving.kernels: this CPU has no AVX2; the engine uses torch's operators")
        return None
    return build_library(compile_flags())


def build_library(flags: list[str]) -> ctypes.CDLL | None:
    """kernels.c compiled with these flags (once: kept in the cache folder under their digest) and loaded, or None
    where it does not compile."""
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"kernels-{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            try:
                subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, text=True)
            except (OSError, subprocess.CalledProcessError) as error:
                log.warning("serving.kernels: could not compile %s with %s (%s); the engine uses torch's operators "
                            "(install a C compiler, or set CC, for the faster kernels)", SOURCE.name, compiler,
                            getattr(error, "stderr", None) or error)
                return None
            built.replace(path)  # atomic: a concurrent process never loads a half-written file
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, RESULT_TYPES.get(name)
    return lib


def struct_layouts(lib: ctypes.CDLL) -> dict[str, dict[str | None, tuple[int, int]]]:
    """What the compiled kernels say of their structs: {struct: {field: (offset, size)}, the struct's own size under
    None}, to compare with serving/kernel_abi.py's Structures."""
    entries = ctypes.POINTER(FieldLayout)()
    count = lib.kernel_layouts(ctypes.byref(entries))
    layouts: dict[str, dict[str | None, tuple[int, int]]] = {}
    for entry in entries[:count]:
        field = entry.field.decode() if entry.field else None
        layouts.setdefault(entry.type.decode(), {})[field] = (entry.offset, entry.size)
    return layouts


def python_layouts() -> dict[str, dict[str | None, tuple[int, int]]]:
    """The same of serving/kernel_abi.py's Structures."""
    return {name: {None: (0, ctypes.sizeof(struct)),
                   **{field: (getattr(struct, field).offset, getattr(struct, field).size) for field, _ in struct._fields_}}
            for name, struct in STRUCTS.items()}


def argmax(x: torch.Tensor) -> list[int]:
    """Each row's argmax of [rows, n] float32 values as a list, as x.argmax(-1).tolist() (the first index on ties,
    the first NaN if any) but vectorised: torch's CPU argmax reads ~1 float per ns, 0.3 ms for a 5-row verify's
    logits over a 49k vocabulary."""
    if x.dim() != 2 or not x.shape[0] or not x.shape[1] or x.stride(-1) != 1 or not _uses_kernels(x):
        return x.argmax(-1).tolist()
    out = torch.empty(x.shape[0], dtype=torch.long, device="cpu")
    library().argmax_rows(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], out.data_ptr())
    return out.tolist()


def top_log_probs(logits: torch.Tensor, num: int,
                  temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As (logits / temperature).log_softmax(-1).topk(num, dim=-1) over [..., n] float32 logits: the log-probabilities
    of each row's `num` largest, largest first, and their indices; temperature one for every row or a tensor that
    broadcasts as [..., 1]. In one call of kernels.c's top_log_probs where the kernels run (the lower index first on
    ties; the log-probabilities within a few ulps of torch's), torch's operators elsewhere."""
    if not _uses_kernels(logits) or not 0 < num <= logits.shape[-1] or not logits.numel():
        return (logits.float() / temperature).log_softmax(-1).topk(num, dim=-1)
    rows, lead = _rows(logits), logits.shape[:-1]
    if isinstance(temperature, torch.Tensor):
        temperatures = temperature.to(torch.float32).expand(*lead, 1).reshape(-1).contiguous()
        t, t_stride = temperatures.data_ptr(), 1
    else:  # one for every row, read through a stride of 0 (`scalar` holds it until the call returns)
        scalar = ctypes.c_float(temperature)
        t, t_stride = ctypes.addressof(scalar), 0
    log_probs = torch.empty(rows.shape[0], num, device="cpu")
    indices = torch.empty(rows.shape[0], num, dtype=torch.long, device="cpu")
    library().top_log_probs(rows.data_ptr(), rows.shape[0], rows.stride(0), rows.shape[1], t, t_stride, num,
                            log_probs.data_ptr(), indices.data_ptr())
    return log_probs.view(*lead, num), indices.view(*lead, num)


def _uses_kernels(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class _KernelModule(nn.Module):
    """Calls a kernel with the addresses of its frozen tensors, read once (per-call Python costs add up to
    milliseconds per step at ~200 calls) and again after any move, which must keep them float32 on CPU."""

    weight_dtype = torch.float32  # of the tensors the kernel reads as weights

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        if self.lib is not None:
            if any(t.device.type != "cpu" or t.dtype not in (torch.float32, self.weight_dtype)
                   for t in [*self.parameters(), *self.buffers()]) or self.weights().dtype != self.weight_dtype:
                raise RuntimeError(f"{type(self).__name__} runs serving/kernels.c on float32 CPU tensors: move or cast "
                                   "the module before serving.kernels.for_inference, not after")
            self.read_pointers()
        return self


def to_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 -> [ceil(out / PANEL), pairs, 2 PANEL]: per panel and pair of inputs (2p, 2p + 1), each of
    its PANEL columns' two weights side by side (kernels.c's gemm_pairs), zero past `in` and `out`; pairs is
    ceil(in / 2) rounded up to whole AMX weight tiles (TILE_PAIRS), in every path's panels alike."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    pairs = -(-in_features // (2 * TILE_PAIRS)) * TILE_PAIRS
    padded = weight.new_zeros(num_panels * PANEL, 2 * pairs)
    padded[:out_features, :in_features] = weight
    return padded.view(num_panels, PANEL, pairs, 2).transpose(1, 2).contiguous().view(num_panels, pairs, 2 * PANEL)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / PANEL), in, PANEL], the last panel padded with zero columns. A bfloat16 panel's row
    holds its columns in the order 0, 8, 1, 9, ..., 7, 15 (kernels.c's `load_w` widens them with one load)."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, in_features)
    padded[:out_features] = weight
    panels = padded.view(num_panels, PANEL, in_features).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        panels = panels.unflatten(2, (2, PANEL // 2)).transpose(2, 3)
    return panels.contiguous().view(num_panels, in_features, PANEL)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in], float32 scale [out]): each row's weights over a scale of its own, its largest
    magnitude at 127, rounded to nearest (a row of zeros: scale 1). weight ~ int8 * scale[:, None]."""
    weight = weight.float()
    largest = weight.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def to_int8_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the bytes kernels.c's I8_PANELS reads: `quantize_int8`'s int8 weights as panels ([ceil(out / PANEL),
    in, PANEL], as `to_panels`), then each column's float32 scale (ones past `out`), as one int8 tensor."""
    quantized, scale = quantize_int8(weight)
    panels = to_panels(quantized)
    scales = torch.ones(panels.shape[0] * PANEL, device=weight.device)
    scales[:len(scale)] = scale
    return torch.cat([panels.view(-1), scales.view(torch.int8)])


class PackedLinear(_KernelModule):
    """A frozen nn.Linear for inference: weights as panels for `gemm_panels`, or where the kernels do not run,
    stored transposed, [in, out] (at a few rows torch's x @ W^T runs faster from that layout).

    weight_dtype=torch.bfloat16 stores the weights rounded to bfloat16 (half the bytes to stream per step) and
    still computes in float32, each output still one in-order sum: for drafters, whose precision moves acceptance but
    never the output, and for the target with EngineConfig.weights = bfloat16. weight_dtype=torch.int8 (drafters'
    `draft_weights` "int8") stores them as int8 with a float32 scale per output (`quantize_int8`), a quarter of
    float32's bytes: each output is its scale times the in-order float32 sum of its int8 weights times x.

    compute=torch.bfloat16 (the target with EngineConfig.dtype = bfloat16) also rounds each input to bfloat16 and
    stores the weights as pair panels (`to_pair_panels`) for products on AMX tiles or vdpbf16ps, or widened to float32
    where the CPU has neither (serving.cpu_features.bf16_path): float32 sums, one in-order sum per output in each path."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32,
                 compute: torch.dtype = torch.float32):
        super().__init__()
        if weight_dtype not in (torch.float32, torch.bfloat16, torch.int8):
            raise ValueError(f"PackedLinear stores weights as float32, bfloat16 or int8, not {weight_dtype}")
        if compute not in (torch.float32, torch.bfloat16) or (compute == torch.bfloat16 and weight_dtype != compute):
            raise ValueError(f"PackedLinear computes in float32, or in bfloat16 over bfloat16 weights, not in {compute} "
                             f"over {weight_dtype} weights")
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        self.lib = library() if _uses_kernels(weight) else None
        self.weight_dtype, self.compute = weight_dtype, compute
        # kernels.c's format of these panels (the path chosen once, at load)
        self.format = (PAIR_PATHS[bf16_path()] if compute == torch.bfloat16
                       else {torch.bfloat16: BF16_PANELS, torch.int8: I8_PANELS}.get(weight_dtype, F32_PANELS))
        if self.lib is not None:
            pack = to_pair_panels if compute == torch.bfloat16 else to_int8_panels if self.format == I8_PANELS else to_panels
            self.register_buffer("panels", pack(weight if self.format == I8_PANELS else weight.to(weight_dtype)))
            self.register_buffer("weight_t", None)
        else:  # torch computes in the module's dtype over the values the kernels would read
            quantized, scale = quantize_int8(weight) if weight_dtype == torch.int8 else (None, None)
            values = quantized * scale[:, None] if quantized is not None else weight.to(weight_dtype)
            self.register_buffer("panels", None)
            self.register_buffer("weight_t", values.to(linear.weight.dtype).t().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        if self.lib is not None:
            self.read_pointers()

    def weights(self) -> torch.Tensor:
        return self.panels

    def matrix(self) -> torch.Tensor:
        """The stored weights as [out, in] rows in `weight_dtype` (the panels unpacked; int8 weights as the float32
        values they stand for, each times its scale): for callers that read a few rows of a wide layer instead of the
        whole product (serving/drafters/markov.py)."""
        if self.lib is None:
            return self.weight_t.t().to(torch.float32 if self.format == I8_PANELS else self.weight_dtype).contiguous()
        num_panels, panels, scale = -(-self.out_features // PANEL), self.panels, None
        if self.format == I8_PANELS:  # the int8 panels, then each column's scale
            size = num_panels * self.in_features * PANEL
            panels, scale = panels[:size], panels[size:].view(torch.float32)[:self.out_features]
        if self.format in PAIR_PATHS.values():  # [panels, pairs, (column, pair member)] back to [out, in]
            rows = panels.view(num_panels, -1, PANEL, 2).transpose(1, 2).reshape(num_panels * PANEL, -1)
        else:
            if self.format == BF16_PANELS:  # a bfloat16 panel's columns 0, 8, 1, 9, ... back in order
                panels = panels.view(num_panels, -1, PANEL // 2, 2).transpose(2, 3)
            rows = panels.reshape(num_panels, -1, PANEL).transpose(1, 2).reshape(num_panels * PANEL, -1)
        rows = rows[:self.out_features, :self.in_features].contiguous()
        return rows if scale is None else rows.float() * scale[:, None]

    def read_pointers(self):
        if self.format in PAIR_PATHS.values():
            pairs, path = self.lib.gemm_pairs_bf16, self.format
            self.gemm = lambda *args: pairs(*args, path)
        else:
            self.gemm = {BF16_PANELS: self.lib.gemm_panels_bf16, I8_PANELS: self.lib.gemm_panels_i8}.get(
                self.format, self.lib.gemm_panels)
        self.panels_ptr, self.bias_ptr = self.panels.data_ptr(), _pointer(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is None:
            if self.compute == torch.bfloat16:
                x = x.to(torch.bfloat16).to(x.dtype)
            out = x @ self.weight_t
            return out if self.bias is None else out + self.bias
        if x.dim() != 2 or x.stride(1) != 1:
            return self.forward(_rows(x)).view(*x.shape[:-1], self.out_features)
        if x.dtype != torch.float32:
            raise TypeError(f"a float32 layer got {x.dtype} inputs")
        out = x.new_empty(x.shape[0], self.out_features)
        self.gemm(x.data_ptr(), x.shape[0], x.stride(0), self.panels_ptr, self.in_features, self.out_features,
                  self.bias_ptr, out.data_ptr(), self.out_features)
        return out


class FusedRMSNorm(_KernelModule):
    """An RMSNorm for inference: one `rms_norm` kernel call per tensor where the kernels run."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.reference, self.size, self.eps = norm, norm.weight.shape[0], norm.eps
        self.lib = library() if _uses_kernels(norm.weight) else None
        if self.lib is not None:
            self.read_pointers()

    def weights(self) -> torch.Tensor:
        return self.reference.weight

    def read_pointers(self):
        self.norm, self.weight_ptr = self.lib.rms_norm, self.reference.weight.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is None:
            return self.reference(x)
        if x.dim() != 2 or x.stride(1) != 1:
            return self.forward(_rows(x)).view(x.shape)
        if x.dtype != torch.float32:
            raise TypeError(f"a float32 norm got {x.dtype} inputs")
        out = x.new_empty(x.shape)
        self.norm(x.data_ptr(), x.shape[0], x.stride(0), self.weight_ptr, self.eps, out.data_ptr(), self.size, self.size)
        return out


def for_inference(module: nn.Module, weight_dtype: torch.dtype = torch.float32,
                  compute: torch.dtype = torch.float32) -> nn.Module:
    """Replace, in place, every nn.Linear inside `module` by a PackedLinear (weights stored as `weight_dtype`, products
    in `compute`) and every RMSNorm by a FusedRMSNorm; returns `module`. Call it after the module has its final
    device and dtype."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, weight_dtype, compute))
        elif isinstance(child, RMSNorm):
            setattr(module, name, FusedRMSNorm(child))
        else:
            for_inference(child, weight_dtype, compute)
    return module


class Scratch:
    """The buffers a layer's kernels write between its calls, shared by every layer of a model (they run one after
    another), with their views for a step's row count made once."""

    def __init__(self, config, num_layers: int):
        c = config
        self.config = c
        self.layer_table = (LayerWeights * num_layers)()  # every layer's weights, for model_forward
        self.sizes = {"normed": c.hidden_size, "qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                      "gate_up": 2 * c.intermediate_size, "act": c.intermediate_size, "attn": c.num_heads * c.head_dim,
                      "h": c.hidden_size, "selected": c.hidden_size, "cos": c.head_dim, "sin": c.head_dim,
                      "x": c.attention_input_size}  # x: the attention's input where a head builds it (Eagle3Forward)
        self.buffers = {name: torch.empty(0, size, device="cpu") for name, size in self.sizes.items()}
        self.views: dict[int, tuple] = {}
        self.addresses: dict[int, ForwardScratch] = {}

    def take(self, rows: int) -> tuple:
        """(normed, qkv, q, k, v, gate_up, act) for `rows` rows; q, k, v: [rows, heads, head_dim] views of qkv."""
        if rows not in self.views:
            if rows > len(self.buffers["normed"]):
                self.buffers = {name: torch.empty(max(rows, 2 * len(b)), self.sizes[name], device="cpu")
                                for name, b in self.buffers.items()}
                self.views.clear()
                self.addresses.clear()
            c = self.config
            normed, qkv, gate_up, act = (self.buffers[name][:rows] for name in ("normed", "qkv", "gate_up", "act"))
            q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            self.views[rows] = (normed, qkv, qkv[:, :q_size].unflatten(-1, (c.num_heads, c.head_dim)),
                                qkv[:, q_size:q_size + kv_size].unflatten(-1, (c.num_kv_heads, c.head_dim)),
                                qkv[:, q_size + kv_size:].unflatten(-1, (c.num_kv_heads, c.head_dim)), gate_up, act)
        return self.views[rows]

    def pointers(self, rows: int) -> ForwardScratch:
        """model_forward's scratch for `rows` rows."""
        self.take(rows)  # grows the buffers where needed, which drops the addresses read before
        if rows not in self.addresses:
            self.addresses[rows] = ForwardScratch(**{name: self.buffers[name].data_ptr()
                                                     for name, _ in ForwardScratch._fields_})
        return self.addresses[rows]


class KernelLayer(_KernelModule):
    """A decoder layer (a DecoderLayer after `for_inference`, kept as `reference`) run as kernels.c's layer_pre, the
    attention, and layer_post: three calls per layer where the module makes some twenty torch operators, each costing
    more to dispatch than its arithmetic at decode's few rows. The target's layers and the draft heads' (`kernel_head`)
    alike, a head's without an input norm or with the attention's input built by the head (EAGLE-3's 2 hidden wide).
    Every part still computes a row from that row alone (the norms and products are the same kernels; rope rounds as
    torch does; SiLU through kernels.c's exp, within 2e-7 of torch's). streams: whether its weights come from memory
    at every step (the target's) rather than from cache (a head's), which picks how its few-row products run."""

    def __init__(self, layer: DecoderLayer, scratch: Scratch, streams: bool):
        super().__init__()
        self.reference, self.scratch, self.layer_idx, self.streams = layer, scratch, layer.layer_idx, streams
        self.lib = layer.qkv.lib
        self.weight_dtype = layer.qkv.weight_dtype
        if self.lib is None:
            raise ValueError("KernelLayer runs serving/kernels.c, which does not run here: keep the DecoderLayer")
        self.read_pointers()

    def weights(self) -> torch.Tensor:
        return self.reference.qkv.panels

    def read_pointers(self):
        layer, c = self.reference, self.reference.config
        qk_norm = c.qk_norm
        # a layer without its input norm (EAGLE's: the head norms its inputs) multiplies its input as it comes
        input_norm = layer.input_norm.reference.weight if isinstance(layer.input_norm, FusedRMSNorm) else None
        self.scratch.layer_table[self.layer_idx] = LayerWeights(
            input_norm=_pointer(input_norm),
            post_norm=layer.post_norm.reference.weight.data_ptr(),
            q_norm=layer.q_norm.reference.weight.data_ptr() if qk_norm else None,
            k_norm=layer.k_norm.reference.weight.data_ptr() if qk_norm else None,
            qkv=layer.qkv.panels.data_ptr(), o=layer.o.panels.data_ptr(), gate_up=layer.gate_up.panels.data_ptr(),
            down=layer.down.panels.data_ptr(), qkv_bias=_pointer(layer.qkv.bias),
            format=layer.qkv.format, streams=self.streams, hidden=c.hidden_size, heads=c.num_heads,
            kv_heads=c.num_kv_heads, dim=c.head_dim, intermediate=c.intermediate_size,
            input_size=c.attention_input_size, eps=c.rms_norm_eps)
        self.weights_ref = ctypes.pointer(self.scratch.layer_table[self.layer_idx])
        self.pre, self.post = self.lib.layer_pre, self.lib.layer_post

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
                attention_input: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLayer.forward. hidden: [..., hidden] float32; cos, sin: [..., 1, head_dim] from Rope.tables;
        attention_input: [..., attention_input_size] or None."""
        c = self.reference.config
        shape = hidden.shape
        hidden, cos, sin = (t.reshape(-1, t.shape[-1]).contiguous() for t in (hidden, cos, sin))
        rows = hidden.shape[0]
        if cos.shape[0] != rows or sin.shape[0] != rows:
            raise ValueError(f"KernelLayer got {rows} rows of states and {cos.shape[0]} rows of rope tables")
        if attention_input is not None:
            attention_input = attention_input.reshape(rows, c.attention_input_size).contiguous()
        normed, qkv, q, k, v, gate_up, act = self.scratch.take(rows)
        step = LayerStep(weights=self.weights_ref, rows=rows, h=hidden.data_ptr(), normed=normed.data_ptr(),
                         qkv=qkv.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), gate_up=gate_up.data_ptr(),
                         act=act.data_ptr(), x=_pointer(attention_input))
        self.pre(step)
        lead = shape[:-1]
        attended = attention(self.layer_idx, q.view(*lead, *q.shape[1:]), k.view(*lead, *k.shape[1:]),
                             v.view(*lead, *v.shape[1:])).reshape(rows, -1).contiguous()
        out = torch.empty_like(hidden)
        step.attn, step.out = attended.data_ptr(), out.data_ptr()
        self.post(step)
        return out.view(shape)

    def project(self, x, cos, sin):
        """As DecoderLayer.project (DFlash's context K/V), on the same packed products."""
        return self.reference.project(x, cos, sin)


def kernel_layers(layers: nn.ModuleList, config) -> nn.ModuleList:
    """The target's layers (DecoderLayers after `for_inference`, of LayerConfig `config`) as KernelLayers sharing
    one Scratch where the kernels run; as they are elsewhere."""
    if not len(layers) or layers[0].qkv.lib is None or not config.is_llama:
        return layers  # other layers run torch's operators between their products, still in PackedLinears
    scratch = Scratch(config, len(layers))
    return nn.ModuleList(KernelLayer(layer, scratch, streams=True) for layer in layers)


def kernel_head(head: nn.Module) -> nn.Module:
    """A draft head after `for_inference` with its decoder layers (EAGLE's, MTP's, DFlash's) made KernelLayers sharing
    one Scratch, in place, where the kernels run and the layers are Llama's; returns `head`. A head forward at decode's
    few rows was as much torch's dispatch as arithmetic, and drafting runs some five of them a step."""
    found = [(parent, name, child) for parent in head.modules() for name, child in parent.named_children()
             if isinstance(child, DecoderLayer)]
    if not found or found[0][2].qkv.lib is None or not all(child.config.is_llama for *_, child in found):
        return head
    config = found[0][2].config
    if any(child.config != config for *_, child in found):
        raise ValueError("a head's decoder layers differ in shape: kernel_head shares one scratch among them")
    scratch = Scratch(config, 1 + max(child.layer_idx for *_, child in found))
    for parent, name, child in found:
        setattr(parent, name, KernelLayer(child, scratch, streams=False))
    return head


class KernelForward:
    """The target's whole forward in one call of kernels.c's model_forward, for steps whose every sequence attends in
    the C kernel (AttentionPath.KERNEL): embedding, rope rows, every layer, the aux taps, the final norm, the LM head
    and each logits row's argmax. Around the layers' one call the forward made some ten torch and kernel calls more,
    and after the weights have streamed through the caches the first Python and torch calls of a step cost 20-80 us
    each (docs/benchmarks/engine.md). The same kernels in the same order: the same results as the model's layer
    loop (tests/serving/test_model.py), and each row's argmax as kernels.argmax gives it."""

    def __init__(self, layers: nn.ModuleList, embed: nn.Embedding, rope, norm: FusedRMSNorm, packed_lm_head: PackedLinear):
        self.scratch = layers[0].scratch
        self.run = layers[0].lib.model_forward
        self.embed, self.rope, self.norm, self.packed_lm_head = embed, rope, norm, packed_lm_head
        c = self.scratch.config
        self.hidden_size, self.scale = c.hidden_size, c.attention_scale
        self.args = ForwardArgs()

    def model_fields(self) -> None:
        """The model's fields of the arguments, read at each call (a move of the model changes its addresses)."""
        a, embed, head = self.args, self.embed.weight, self.packed_lm_head
        a.layers, a.embed, a.vocab = self.scratch.layer_table, embed.data_ptr(), embed.shape[0]
        a.cos_table, a.sin_table, a.max_positions = self.rope.cos.data_ptr(), self.rope.sin.data_ptr(), self.rope.cos.shape[0]
        a.norm, a.eps, a.lm_head = self.norm.weight_ptr, self.norm.eps, head.panels_ptr
        a.lm_format, a.scale = head.format, self.scale

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv, logits_rows: torch.Tensor | None,
                 return_hidden: bool, aux_layers, num_layers: int):
        """input_ids, positions: [rows] int64; kv: the step's PagedAttention.paged_kv(); logits_rows: [num_logits]
        int64 rows that need logits (None: all). Returns (logits or None, each logits row's argmax, hidden states
        after the final norm or None, {layer: states before it})."""
        rows, size = input_ids.shape[0], self.hidden_size
        if any(t is not None and (t.dtype != torch.long or not t.is_contiguous())
               for t in (input_ids, positions, logits_rows)):
            raise ValueError("KernelForward takes contiguous int64 ids, positions and logits rows")
        taps = sorted({i for i in aux_layers if i < num_layers})
        aux = torch.empty(len(taps), rows, size, device="cpu") if taps else None
        hidden = torch.empty(rows, size, device="cpu") if return_hidden else None
        num_logits = rows if logits_rows is None else len(logits_rows)
        logits = torch.empty(num_logits, self.packed_lm_head.out_features, device="cpu") if num_logits else None
        best = torch.empty(num_logits, dtype=torch.long, device="cpu")
        taps_array = (ctypes.c_long * len(taps))(*taps) if taps else None
        self.model_fields()
        a = self.args
        a.num_layers, a.ids, a.positions, a.rows = num_layers, input_ids.data_ptr(), positions.data_ptr(), rows
        a.aux_layers, a.num_aux = ctypes.cast(taps_array, _ptr) if taps else None, len(taps)
        a.logits_rows, a.num_logits = _pointer(logits_rows), num_logits
        a.aux, a.hidden_out, a.logits, a.best = _pointer(aux), _pointer(hidden), _pointer(logits), best.data_ptr()
        a.kv, a.scratch = kv, self.scratch.pointers(rows)
        if self.run(a):
            raise ValueError(f"a forward got token ids outside [0, {a.vocab}), positions outside "
                             f"[0, {a.max_positions}) or logits rows outside [0, {rows})")
        return logits, best.tolist(), hidden, {layer: aux[i] for i, layer in enumerate(taps)}


class Eagle3Forward:
    """An EAGLE-3 head's draft forward (heads/eagle3.py's Eagle3.forward; P-EAGLE's is the same) in one call of
    kernels.c's eagle3_forward, for draft steps whose every sequence attends in the C kernel (AttentionPath.KERNEL):
    the embedding, both input norms, the rope rows, the layer and the final norm where norm_output. The module made
    some fifteen torch calls around its layer's two, and a chain drafts four times a step. The same kernels in the same
    order: the same bits as the module (tests/serving/test_head_drafters.py)."""

    def __init__(self, head):
        if not self.applies(head):
            raise ValueError("Eagle3Forward computes an EAGLE-3 head whose layer is a KernelLayer over a float32 "
                             "embedding: keep the module elsewhere")
        self.head, self.layer = head, head.layer
        self.run = self.layer.lib.eagle3_forward
        self.args = Eagle3Args()

    @staticmethod
    def applies(head) -> bool:
        """Whether eagle3_forward computes `head`: an EAGLE-3 (or P-EAGLE) head after `for_inference` and
        `kernel_head`, whose embedding is float32 and whose norms have its layer's epsilon."""
        if not isinstance(head, Eagle3) or not isinstance(head.layer, KernelLayer):
            return False
        norms = (head.input_norm, head.hidden_norm, head.norm)
        return (head.input_embedding().weight.dtype == torch.float32 and all(isinstance(n, FusedRMSNorm) for n in norms)
                and all(n.eps == head.layer.reference.config.rms_norm_eps for n in norms))

    def head_fields(self) -> None:
        """The head's fields of the arguments, read at each call (a move of the head changes its addresses)."""
        a, head, c = self.args, self.head, self.head.config
        embed, rope = head.input_embedding().weight, head.rope
        a.layer, a.embed, a.vocab = self.layer.weights_ref, embed.data_ptr(), embed.shape[0]
        a.input_norm, a.hidden_norm, a.norm = (n.weight_ptr for n in (head.input_norm, head.hidden_norm, head.norm))
        a.norm_before_residual, a.norm_output = c.norm_before_residual, c.norm_output
        a.cos_table, a.sin_table, a.max_positions = rope.cos.data_ptr(), rope.sin.data_ptr(), rope.cos.shape[0]

    def __call__(self, input_ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """As Eagle3.forward: input_ids, positions [rows] int64; g [rows, hidden] float32; attention a PagedAttention
        on AttentionPath.KERNEL over the head's one-layer pool. Returns out [rows, hidden]."""
        kv = attention.paged_kv()
        if kv is None:
            raise ValueError("Eagle3Forward attends in the C kernel only: run the module on other attention paths")
        if input_ids.dtype != torch.long or positions.dtype != torch.long or g.dtype != torch.float32:
            raise ValueError("Eagle3Forward takes int64 ids and positions and float32 features")
        input_ids, positions, g = input_ids.contiguous(), positions.contiguous(), g.contiguous()
        rows = input_ids.shape[0]
        self.head_fields()
        scratch = self.layer.scratch
        a = self.args
        a.scratch = scratch.pointers(rows)
        out = torch.empty(rows, g.shape[-1], device="cpu")
        a.scale, a.window, a.kv = attention.cache.scale, attention.cache.windows[0], kv
        a.ids, a.positions, a.rows, a.g = input_ids.data_ptr(), positions.data_ptr(), rows, g.data_ptr()
        a.x, a.out = scratch.buffers["x"].data_ptr(), out.data_ptr()
        if self.run(a):
            raise ValueError(f"a draft got token ids outside [0, {a.vocab}) or positions outside [0, {a.max_positions})")
        return out
