"""The structs that serving/kernels.c's larger calls take, as ctypes Structures: the same names, fields and order as
the typedefs at the top of kernels.c (tests/serving/test_kernels.py compares every offset and size with the ones the
compiled library reports). A field added on one side goes on the other in the same place.

The leaf kernels (gemm_panels, rms_norm, argmax_rows) keep BLAS-like argument lists (serving/kernels.py, SIGNATURES).
"""
from __future__ import annotations

import ctypes

_long, _ptr, _float = ctypes.c_long, ctypes.c_void_p, ctypes.c_float


class LayerWeights(ctypes.Structure):
    """layer_weights: a decoder layer's weights (q_norm, k_norm, qkv_bias NULL where the model has none; the four
    matrices as panels in the format `format` names: serving/kernels.py's F32_PANELS, BF16_PANELS, I8_PANELS or a
    PAIR_PATHS value;
    streams 1 for weights read from memory at every step, the target's, 0 for a head's kept in cache)."""
    _fields_ = [*((name, _ptr) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "o", "gate_up", "down",
                                             "qkv_bias")),
                *((name, _long) for name in ("format", "streams", "hidden", "heads", "kv_heads", "dim", "intermediate",
                                             "input_size")),
                ("eps", _float)]


class Sequence(ctypes.Structure):
    """sequence: one sequence of an attention batch, its rows and keys."""
    _fields_ = [("first_row", _long), ("query_rows", _long), ("context", _long), ("tree_rows", _long),
                ("first_path", _long)]


class AttentionBatch(ctypes.Structure):
    """attention_batch: the attention metadata of a step's short sequences (serving/attention.py, ShortQueries):
    new_slots [num_new], seqs [num_seqs] Sequences, slots [num_seqs][slot_stride], paths [tree rows][path_stride]."""
    _fields_ = [("new_slots", _ptr), ("num_new", _long), ("seqs", _ptr), ("num_seqs", _long), ("slots", _ptr),
                ("slot_stride", _long), ("paths", _ptr), ("path_stride", _long)]


class AttentionArgs(ctypes.Structure):
    """attention_args: paged_attention's arguments, one layer's attention of a batch."""
    _fields_ = [("q", _ptr), ("q_stride", _long), ("out", _ptr), ("k_pool", _ptr), ("v_pool", _ptr), ("k_new", _ptr),
                ("v_new", _ptr), ("k_stride", _long), ("v_stride", _long), ("heads", _long), ("kv_heads", _long),
                ("dim", _long), ("scale", _float), ("window", _long), ("sinks", _ptr),
                ("batch", ctypes.POINTER(AttentionBatch))]


class LayerStep(ctypes.Structure):
    """layer_step: layer_pre's and layer_post's arguments, one layer on `rows` rows."""
    _fields_ = [("weights", ctypes.POINTER(LayerWeights)), ("rows", _long),
                *((name, _ptr) for name in ("h", "normed", "qkv", "cos", "sin", "attn", "out", "gate_up", "act", "x"))]


class PagedKV(ctypes.Structure):
    """paged_kv: every layer's K/V pools of a step whose sequences all attend in the C kernel, and its batch."""
    _fields_ = [("k_pool", _ptr), ("v_pool", _ptr), ("layer_floats", _long),
                ("batch", ctypes.POINTER(AttentionBatch))]


class ForwardScratch(ctypes.Structure):
    """forward_scratch: model_forward's buffers for intermediate results (serving/kernels.py, Scratch)."""
    _fields_ = [(name, _ptr) for name in ("h", "normed", "qkv", "attn", "gate_up", "act", "cos", "sin", "selected")]


class ForwardArgs(ctypes.Structure):
    """forward_args: model_forward's arguments, the model's (set once it is loaded) and then the step's."""
    _fields_ = [("layers", ctypes.POINTER(LayerWeights)), ("num_layers", _long), ("embed", _ptr), ("vocab", _long),
                ("cos_table", _ptr), ("sin_table", _ptr), ("max_positions", _long), ("norm", _ptr), ("eps", _float),
                ("lm_head", _ptr), ("lm_format", _long), ("scale", _float),
                ("ids", _ptr), ("positions", _ptr), ("rows", _long), ("aux_layers", _ptr), ("num_aux", _long),
                ("logits_rows", _ptr), ("num_logits", _long), ("aux", _ptr), ("hidden_out", _ptr), ("logits", _ptr),
                ("best", _ptr), ("kv", PagedKV), ("scratch", ForwardScratch)]


class Eagle3Args(ctypes.Structure):
    """eagle3_args: eagle3_forward's arguments, an EAGLE-3 head's (set once it is loaded) and then the draft step's."""
    _fields_ = [("layer", ctypes.POINTER(LayerWeights)), ("embed", _ptr), ("vocab", _long), ("input_norm", _ptr),
                ("hidden_norm", _ptr), ("norm", _ptr), ("norm_before_residual", _long), ("norm_output", _long),
                ("cos_table", _ptr), ("sin_table", _ptr), ("max_positions", _long), ("scale", _float),
                ("window", _long), ("kv", PagedKV), ("ids", _ptr), ("positions", _ptr), ("rows", _long), ("g", _ptr),
                ("x", _ptr), ("scratch", ForwardScratch), ("out", _ptr)]


class FieldLayout(ctypes.Structure):
    """field_layout: kernel_layouts' entries (field NULL: the struct's own size)."""
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _long), ("size", _long)]


# kernels.c's struct names -> their Structures
STRUCTS = {"layer_weights": LayerWeights, "sequence": Sequence, "attention_batch": AttentionBatch,
           "attention_args": AttentionArgs, "layer_step": LayerStep, "paged_kv": PagedKV,
           "forward_scratch": ForwardScratch, "forward_args": ForwardArgs, "eagle3_args": Eagle3Args}
