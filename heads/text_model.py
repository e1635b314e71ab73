"""Where a Hugging Face folder keeps its language model: the text config and the text model's tensor names.

A causal LM (LlamaForCausalLM, Gemma3ForCausalLM, ...) keeps its fields at the top of config.json and its tensors
as `model.*` and `lm_head.weight`. A multimodal checkpoint (Gemma3ForConditionalGeneration, Llama 4, LLaVA,
Mistral 3, Qwen-VL) nests the language model's fields under `text_config` and its tensors under a prefix, beside
a vision tower and a projector that draft heads and the engine never read. `text_config` and `text_name` turn
either layout into the causal LM's, so every reader of a target (its parts, the engine's loader, fingerprints)
names one layout.
"""
from __future__ import annotations

# A checkpoint's tensor-name prefix -> the causal LM's, tried in order (the longest first).
TEXT_PREFIXES = (
    ("model.language_model.", "model."),  # transformers >= 4.52 in memory, and checkpoints saved that way
    ("language_model.model.", "model."),  # Gemma 3, Llama 4, LLaVA and Mistral 3 checkpoints as released
    ("language_model.lm_head.", "lm_head."),  # their untied LM head
    ("model.", "model."),  # a causal LM; Qwen2-VL's text model as released (its vision tower is `visual.*`)
    ("lm_head.", "lm_head."),
)
# What a text model holds under `model.`; anything else under it (a vision tower) is not the language model's.
TEXT_MODULES = ("embed_tokens.", "layers.", "norm.")

# The causal LM whose layers a multimodal checkpoint's language model has, by its text config's model_type: the
# engine loads those (a text-only request runs the language model alone).
TEXT_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}


def is_multimodal(config: dict) -> bool:
    return isinstance(config.get("text_config"), dict)


def text_config(config: dict) -> dict:
    """The language model's config: config.json itself for a causal LM, else its `text_config`. Tying follows
    transformers: the top config's tie_word_embeddings where it sets one, else the text config's."""
    if not is_multimodal(config):
        return config
    text = dict(config["text_config"])
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text.setdefault("model_type", config.get("model_type", ""))
    return text


def text_architecture(config: dict) -> str:
    """The transformers class whose layers the language model has: the causal LM of TEXT_ARCHITECTURES for a
    multimodal checkpoint that has one, else the first of `architectures` (the model_type when none)."""
    own = (config.get("architectures") or [config.get("model_type", "?")])[0]
    if not is_multimodal(config):
        return own
    return TEXT_ARCHITECTURES.get(text_config(config)["model_type"], own)


def text_name(name: str) -> str | None:
    """The causal LM's name of checkpoint tensor `name` (`language_model.model.norm.weight` -> `model.norm.weight`),
    or None for a tensor outside the language model (a vision tower's, a projector's)."""
    for prefix, ours in TEXT_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if ours == "lm_head." or rest.startswith(TEXT_MODULES):
                return ours + rest
            return None
    return None


def checkpoint_names(ours: str) -> list[str]:
    """The names a checkpoint may give the causal LM's tensor `ours`, in TEXT_PREFIXES' order."""
    return [prefix + ours[len(own):] for prefix, own in TEXT_PREFIXES if ours.startswith(own)]

