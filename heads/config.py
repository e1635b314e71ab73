"""What every head checkpoint records in config.json: its kind, the format version, the target's sizes and
decoder-layer settings (so a head is built without the target folder), the target's fingerprint and free
training metadata. Each head kind subclasses `HeadConfig` with its own fields."""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import ClassVar

from heads.layer import LayerConfig
from heads.rope import Rope

FORMAT_VERSION = 1
SIZE_FIELDS = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_layers": "num_target_layers"}


@dataclass
class HeadConfig:
    kind: ClassVar[str] = ""
    # whether the kind's draft layers run with a sliding window when draft_window asks (EAGLE-1, EAGLE-3, MTP, P-EAGLE)
    takes_draft_window: ClassVar[bool] = True

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_target_layers: int
    max_position_embeddings: int
    head_dim: int = 0  # 0 derives hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    target_fingerprint: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    # p(draft) = softmax(logits / T_i)[draft] at draft position i for the engine's confidence cut, fitted on held-out
    # data by training (training/modules/calibration.py); empty: T = 1 at every position
    confidence_temperatures: list = field(default_factory=list)
    # Medusa, EAGLE-1, MTP: the head drafts among this many target tokens, their ids the checkpoint's `token_map`
    # tensor (heads/token_map.py); 0: the whole vocabulary
    token_map_size: int = 0
    # the draft layers' sliding window: keys a row at position p sees are those at positions > p - draft_window (the
    # row's own included), as a target's sliding-window layer and vLLM's `sliding_window`; 0: every key (full attention)
    draft_window: int = 0
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "num_target_layers", "max_position_embeddings"):
            require_positive_int(self, name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not isinstance(self.target_fingerprint, dict) or not isinstance(self.metadata, dict):
            raise ValueError("target_fingerprint and metadata must be JSON objects (dicts)")
        temperatures = self.confidence_temperatures
        if not isinstance(temperatures, list) or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in temperatures):
            raise ValueError(f"confidence_temperatures={temperatures!r} must be a list of positive numbers, one per "
                             "draft position (empty for none)")
        size = self.token_map_size
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= self.vocab_size:
            raise ValueError(f"token_map_size={size!r} must be an integer in [0, vocab_size={self.vocab_size}] (0: no map)")
        window = self.draft_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"draft_window={window!r} must be an integer >= 0 (keys a draft row sees back from itself; "
                             "0: full attention)")
        if window and not self.takes_draft_window:
            raise ValueError(f"draft_window={window}: a {self.kind} head has no windowed draft layer (EAGLE-1, "
                             "EAGLE-3, MTP and P-EAGLE heads do); leave draft_window 0")
        recorded = self.mismatches(self.target_fingerprint)
        if recorded:
            raise ValueError(f"target_fingerprint disagrees with the head's own sizes: {'; '.join(recorded)}")

    @classmethod
    def from_target(cls, parts, intermediate_size: int | None = None, **kind_fields) -> "HeadConfig":
        """The config of a new head for target `parts` (heads.TargetParts); `kind_fields` are the kind's own, or
        override what the target gives. A decoder layer of the head gets the target's MLP width unless
        `intermediate_size` is given."""
        layer = parts.layer
        from_target = dict(
            hidden_size=layer.hidden_size, vocab_size=parts.vocab_size, num_attention_heads=layer.num_heads,
            num_key_value_heads=layer.num_kv_heads,
            intermediate_size=layer.intermediate_size if intermediate_size is None else intermediate_size,
            num_target_layers=parts.num_layers, max_position_embeddings=parts.max_position_embeddings,
            head_dim=layer.head_dim, rms_norm_eps=layer.rms_norm_eps, attention_bias=layer.qkv_bias,
            qk_norm=layer.qk_norm, rope_theta=parts.rope_theta, rope_scaling=parts.rope_scaling,
            target_fingerprint=dict(parts.fingerprint or {}),
        )
        return cls(**{**from_target, **kind_fields})

    @classmethod
    def from_dict(cls, data: dict) -> "HeadConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(data.keys() - known - {"kind"})
        if unknown:
            raise ValueError(f"unknown {cls.kind} config field(s) {unknown}; known fields: {sorted(known)}")
        missing = [f.name for f in fields(cls)
                   if f.default is MISSING and f.default_factory is MISSING and f.name not in data]
        if missing:
            raise ValueError(f"missing {cls.kind} config field(s) {missing}")
        return cls(**{key: value for key, value in data.items() if key != "kind"})

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}

    def layer_config(self, attention_input_size: int = 0) -> LayerConfig:
        return LayerConfig(
            hidden_size=self.hidden_size, num_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            qkv_bias=self.attention_bias, qk_norm=self.qk_norm, attention_input_size=attention_input_size,
        )

    def rope(self) -> Rope:
        return Rope(self.head_dim, self.max_position_embeddings, self.rope_theta, self.rope_scaling)

    def mismatches(self, target: dict) -> list[str]:
        """How `target` (a fingerprint, or TargetParts.describe()) differs from the target this head was made
        for: its recorded fingerprint field by field, then its own sizes."""
        recorded = self.target_fingerprint
        differing = [key for key in sorted(recorded.keys() & target.keys()) if key != "id" and recorded[key] != target[key]]
        if not differing and recorded.get("id", target.get("id")) != target.get("id", recorded.get("id")):
            differing = ["id"]
        found = [f"{key}: head {recorded[key]!r}, target {target[key]!r}" for key in differing]
        for key, own in SIZE_FIELDS.items():
            if key in target and key not in differing and getattr(self, own) != target[key]:
                found.append(f"{key}: head {getattr(self, own)!r}, target {target[key]!r}")
        return found


def is_positive_int(value) -> bool:
    """An int >= 1 and not a bool (which Python counts as an int): every positive-integer option's test."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def require_positive_int(config, name: str) -> None:
    value = getattr(config, name)
    if not is_positive_int(value):
        raise ValueError(f"{type(config).__name__}.{name} must be a positive integer, got {value!r}")
