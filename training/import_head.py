"""`draftheads import`: a published or exported draft head (EAGLE-1, EAGLE-3, Medusa, P-EAGLE, DFlash, DSpark) as a
head
folder for a target, read through the same name maps `draftheads export` writes with (training/formats.py):

    draftheads import ~/hf/EAGLE3-LLaMA3.1-Instruct-8B --format eagle3 --target ~/hf/Llama-3.1-8B-Instruct --out heads/e3
    draftheads import exported/eagle --format eagle --from sglang --target debug --out heads/eagle

SRC is a local folder (a downloaded hub repository) with config.json and the weights (*.safetensors, else
pytorch_model.bin, or Medusa's medusa_lm_head.safetensors / .pt, which hold MedusaModel.medusa_head's tensors).
--from is read from config.json when not given: what wrote it when `draftheads export` did (its "draftheads" key),
the speculators format's speculators_model_type, else its architecture (EagleLlamaForCausalLM: vllm,
LlamaForCausalLMEagle: sglang, LlamaForCausalLM: eagle-repo, LlamaForCausalLMEagle3: vllm, MedusaModel: vllm,
DFlashDraftModel: z-lab, Qwen3DSparkModel: vllm) or
Medusa's medusa_num_heads (medusa-repo). An EAGLE-3 file that names its aux layers needs --from, since SGLang
numbers them one lower than vLLM and the EAGLE repository.

The speculators format's trainer writes target_hidden_size null (the layer's hidden size), no d2t and t2d over the
whole vocabulary, and names its verifier: a folder present here must be the target (the same fingerprint); a hub id
not present here is imported for --target, whose sizes are checked against the checkpoint's.

Every tensor is checked against the shape the target's sizes and the checkpoint's config.json imply, and a wrong
one is named with both shapes. The head's attention geometry, norm epsilon and rope are the target's (config.json
must agree on the sizes); its MLP width, and each kind's own settings, are the checkpoint's. Tensors of the target
a file carries (EAGLE's embed_tokens, vLLM Medusa's shared LM head) are checked and left out; an EAGLE-3 or P-EAGLE
embed_tokens that vLLM reads and that differs from the target's (speculators trains P-EAGLE's by default) becomes the
head's own embedding, as vLLM serves it. Calibrated confidence
temperatures are not part of these layouts: `draftheads fit --model.init_args.init_from OUT` recalibrates them.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

import heads
from heads.checkpoint import HEADS
from heads.draft_head import DraftHead
from heads.hf_folder import read_config, read_file, weight_files
from heads.token_map import check_token_ids, lm_head_rows
from training.cli import DocHelpFormatter
from training.formats import LAYOUTS, SOURCES, Layout
from training.name_maps import to_ours, without_output_bias

KINDS = ("eagle", "eagle3", "medusa", "peagle", "dflash", "dspark")
SOURCE_OF = {"EagleLlamaForCausalLM": "vllm", "LlamaForCausalLMEagle": "sglang", "LlamaForCausalLM": "eagle-repo",
             "LlamaForCausalLMEagle3": "vllm", "MedusaModel": "vllm", "EagleSpeculator": "speculators",
             "Eagle3Speculator": "speculators", "PEagleSpeculator": "speculators", "DFlashDraftModel": "z-lab",
             "DFlashSpeculator": "speculators", "DSparkSpeculator": "speculators", "Qwen3DSparkModel": "vllm"}
KIND_OF = {"EagleLlamaForCausalLM": "eagle", "LlamaForCausalLMEagle": "eagle", "LlamaForCausalLMEagle3": "eagle3",
           "MedusaModel": "medusa", "EagleSpeculator": "eagle", "Eagle3Speculator": "eagle3", "PEagleSpeculator": "peagle",
           "DFlashDraftModel": "dflash", "DFlashSpeculator": "dflash", "DSparkSpeculator": "dspark",
           "Qwen3DSparkModel": "dspark",
           "Eagle3DraftModel": "eagle3", "PEagleDraftModel": "peagle"}  # the last two: speculators' save_pretrained
WRITER = "draftheads"  # what `draftheads export` records in config.json: version, kind, format
TORCH_FILES = ("pytorch_model.bin", "medusa_lm_head.pt")
MEDUSA_FILE = "medusa_lm_head"  # its tensors are MedusaModel.medusa_head's, named from inside it
SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def add_arguments(parser) -> None:
    parser.description, parser.formatter_class = __doc__, DocHelpFormatter
    parser.add_argument("src", help="folder of the published or exported head (config.json and its weights)")
    parser.add_argument("--format", choices=KINDS, required=True, help="the head's kind")
    parser.add_argument("--from", dest="source", choices=SOURCES, default=None,
                        help="the layout it is in (default: read from its config.json)")
    parser.add_argument("--target", default=None, help="the target the head drafts for (default: the built-in one)")
    parser.add_argument("--out", required=True, help="the head folder to write")


def run(args) -> int:
    from serving import targets

    target = args.target or targets.DEFAULT_TARGET
    head, layout = import_head(args.src, args.format, target, args.source)
    out = heads.save(head, args.out, metadata={"imported": {"from": str(args.src), "layout": layout.source}})
    print(f"wrote the {layout.source} {args.format} head in {args.src} as a head folder for {target} to {out}")
    return 0


@dataclass
class ReadHead:
    """A head file read through its layout, as the engine that loads that layout reads it: the head bound to the
    target, the layout, the file's flat config.json, and `unread`, its tensors the layout (that engine's model)
    has no place for."""
    head: DraftHead
    layout: Layout
    config: dict
    unread: dict[str, torch.Tensor]
    where: str


def import_head(src, kind: str, target, source: str | None = None) -> tuple[DraftHead, Layout]:
    """The head in folder `src` (kind `kind`, layout `source` or the one its config.json names) for the target
    `target` (a name or folder serving.targets resolves), bound to that target's parts; a file with tensors the
    layout has no place for is refused."""
    read = read_head(src, kind, target, source)
    if read.unread:
        raise ValueError(f"{read.where} has tensor(s) {sorted(read.unread)} that this {kind} head has no place for")
    return read.head, read.layout


def read_head(src, kind: str, target, source: str | None = None) -> ReadHead:
    """import_head's reading, which keeps the tensors the layout has no place for (`unread`) instead of refusing
    them: what `draftheads check` compares an export with."""
    from serving import targets

    src = Path(src)
    config = read_config(src, "import reads a head's folder (config.json and its weights)")
    layout = _layout(config, kind, source, src)
    config = layout.format.flat_config(config)
    folder = targets.resolve(target)
    parts = heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))
    where = f"{src} ({layout.source} {kind} layout)"
    _check_sizes(config, parts, where)
    _check_verifier(config, parts.fingerprint, target, where)
    cls = HEADS[kind]
    theirs = _read_tensors(src)
    try:
        head_config = cls.config_class.from_target(parts, **layout.kind_fields(config, where),
                                                   **layout.tensor_fields(theirs, parts, where),
                                                   **layout.window_fields(config, where))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: its config.json does not make a {kind} head for this target: {error}") from None
    with torch.device("cpu"):
        head = cls(head_config)
    theirs = without_output_bias(layout.fill(config, head_config, theirs, where), where)
    ours, used = to_ours(layout.names, head_config, theirs, head.state_dict(), where)
    for name, shape in layout.target_tensors(head_config).items():
        if name in theirs and tuple(theirs[name].shape) != shape:
            raise ValueError(f"{where}: tensor {name} (the target's) has shape {tuple(theirs[name].shape)}, expected "
                             f"{shape} from the target's sizes")
        used.add(name)
    unread = {name: theirs[name] for name in sorted(theirs.keys() - used)}
    head.load_state_dict(ours)
    _check_vocabulary(head, where)
    if head.token_map is not None:
        parts.lm_head = lm_head_rows(parts.lm_head, head.token_map)
    head.bind_target(parts)
    layout.check_target(theirs, head, where)
    return ReadHead(head, layout, config, unread, where)


def _layout(config: dict, kind: str, source: str | None, src: Path) -> Layout:
    architecture = (config.get("architectures") or [None])[0]
    named = KIND_OF.get(architecture)
    if named is not None and named != kind:
        raise ValueError(f"{src}/config.json names {architecture} (kind {named}): import it with --format {named}")
    written = config.get(WRITER)
    if isinstance(written, dict) and written.get("kind") not in (None, kind):
        raise ValueError(f"{src} is a {written['kind']} head exported by draftheads: import it with --format "
                         f"{written['kind']}")
    if source is None:
        eagle3_ids = "eagle_aux_hidden_state_layer_ids"
        if isinstance(written, dict) and written.get("format") in SOURCES:
            source = written["format"]
        elif "speculators_model_type" in config:
            source = "speculators"
        elif "medusa_num_heads" in config:
            source = "medusa-repo"
        elif architecture == "LlamaForCausalLMEagle3" and (eagle3_ids in config or eagle3_ids in (config.get("eagle_config") or {})):
            raise ValueError(f"{src}/config.json names EAGLE-3 aux layers, which SGLang numbers one lower than vLLM and "
                             "the EAGLE repository: say which it was written for with --from vllm, sglang or eagle-repo")
        elif architecture in SOURCE_OF:
            source = SOURCE_OF[architecture]
        else:
            raise ValueError(f"{src}/config.json names no architecture this import knows ({architecture!r}): say "
                             f"which layout it is in with --from ({', '.join(SOURCES)})")
    if (kind, source) not in LAYOUTS:
        known = ", ".join(s for k, s in LAYOUTS if k == kind)
        raise ValueError(f"no {kind} layout from {source}: a {kind} head comes from {known}")
    return LAYOUTS[kind, source]


def _check_sizes(config: dict, parts, where: str) -> None:
    layer = parts.layer
    target = {"hidden_size": layer.hidden_size, "num_attention_heads": layer.num_heads,
              "num_key_value_heads": layer.num_kv_heads, "head_dim": layer.head_dim, "vocab_size": parts.vocab_size}
    differing = [f"{name}: checkpoint {config[name]}, target {target[name]}" for name in SIZES
                 if config.get(name) is not None and config[name] != target[name]]
    if differing:
        raise ValueError(f"{where} was made for another target: {'; '.join(differing)}")


def _check_verifier(config: dict, fingerprint: dict, target, where: str) -> None:
    """The speculators format names the verifier it was trained for. A folder present here must be the target (its
    fingerprint the same); a hub id not present here is imported for the target all the same, whose sizes were
    checked against the checkpoint's."""
    name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not name or not (Path(name).expanduser() / "config.json").is_file():
        return
    from serving import targets

    theirs = targets.fingerprint(Path(name).expanduser())
    differing = [f"{key}: verifier {theirs[key]!r}, target {fingerprint[key]!r}" for key in sorted(theirs)
                 if key != "id" and theirs[key] != fingerprint.get(key)]
    if differing:
        raise ValueError(f"{where} names its verifier {name}, which is not the target {target}: "
                         f"{'; '.join(differing)}. Import it with --target {name}, or for the target it was trained on")


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    files = weight_files(src) or [src / name for name in TORCH_FILES if (src / name).is_file()]
    if not files:
        raise ValueError(f"{src} has no weights: expected *.safetensors, {' or '.join(TORCH_FILES)}")
    tensors = {}
    for file in files:
        try:
            read = read_file(file) if file.suffix == ".safetensors" else torch.load(
                file, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, pickle.UnpicklingError) as error:
            raise ValueError(f"{file} is unreadable ({error})") from None
        prefix = "medusa_head." if file.stem == MEDUSA_FILE else ""
        tensors.update({prefix + name: tensor for name, tensor in read.items()})
    return tensors


def _check_vocabulary(head: DraftHead, where: str) -> None:
    """EAGLE-3's d2t must give distinct target ids, ascending, that t2d marks; a token map distinct ids."""
    if head.token_map is not None:
        check_token_ids(head.token_map, head.config.vocab_size, f"{where}: token_map")
    if isinstance(head, heads.Eagle3):  # P-EAGLE's too
        ids = head.draft_token_ids
        fine = bool((ids >= 0).all() and (ids < head.config.vocab_size).all() and (ids.diff() > 0).all())
        if not fine or int(head.t2d.sum()) != len(ids) or not head.t2d[ids.clamp(0, head.config.vocab_size - 1)].all():
            raise ValueError(f"{where}: d2t and t2d do not describe one draft vocabulary (target id = draft id + "
                             "d2t[draft id], ascending and distinct, each marked in t2d)")
