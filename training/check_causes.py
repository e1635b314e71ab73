"""What `draftheads check` names once a served column falls behind: the causes it finds by reading the head, its
export and the targets, rather than guessed from where the gap starts.

vLLM below the engine (`export_causes`): the export is read as vLLM's model reads it (import's layouts,
training/import_head.read_head) and compared with the head the engine ran:

- tensors the layout (vLLM's model class for that method) has no place for: vLLM's weight loader drops an
  unexpected `.bias` without a word (so a nonzero one, e.g. EAGLE-1's fc bias, is lost there), and refuses to start
  on any other name;
- the fused target layers: vLLM captures each of the export's `eagle_aux_hidden_state_layer_ids` once, in ascending
  order, and feeds fc's column blocks in that order, whatever order the file lists them in; the block the head
  trained on layer a must be the one fed layer a;
- the settings and weights of the layer as read, against the head's (norm_before_fc and the other EAGLE 3.1 norms,
  the draft vocabulary, a tensor of another head);
- rope: the export's rope_theta / rope_scaling (vLLM's draft layer rotates by them) against the head's, and those of
  the target vLLM serves (its config.json) against those of the target the engine ran.

The engine below training (`head_causes`): the head folder's settings against those its fit trained with (the
hparams the fit recorded in metadata.training, the store's aux layers), and its rope against the target's now.
"""
from __future__ import annotations

from pathlib import Path

import torch

from heads.hf_folder import read_config
from heads.rope import rope_settings

# a head kind's fused target layers (fc's column blocks, one per layer, in this order): its config field
FUSED_LAYERS = {"eagle3": "aux_layers", "peagle": "aux_layers", "dflash": "target_layers", "dspark": "target_layers"}
# tensors laid out in the fused layers' order
FUSED_TENSORS = ("fc.weight", "fc_input_norm.weight", "fc_norm.", "mask_hidden")
# head config fields an export does not carry or that a fit writes, and fc_bias, seen in the tensors (a zero bias
# is none): never a cause by themselves
NOT_COMPARED = {"target_fingerprint", "metadata", "confidence_temperatures", "format_version", "fc_bias"}
# an export copies the head's tensors (fc's blocks of a layer named twice summed): equal up to float32 rounding
ATOL = 1e-6


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return torch.allclose(a.float(), b.float(), atol=ATOL)
    return torch.equal(a, b)


def fused_layers(kind: str, config) -> tuple[int, ...]:
    return tuple(config.to_dict()[FUSED_LAYERS[kind]]) if kind in FUSED_LAYERS else ()


def describe_rope(rope: tuple[float, dict | None]) -> str:
    theta, scaling = rope
    return f"rope_theta {theta:g}" + (f", rope_scaling {scaling}" if scaling else "")


def export_causes(head, export: Path, target: Path, served_target: Path | None) -> list[str]:
    """Why vLLM, serving `export` (a folder) over `served_target` (its folder, None where unknown), may draft other
    tokens than the engine running `head` (loaded, bound) over `target`; [] where nothing differs."""
    from training.import_head import read_head

    kind = head.config.kind
    causes = []
    if served_target is not None:
        causes += target_causes(target, served_target)
    try:
        read = read_head(export, kind, target)
    except ValueError as error:
        return causes + [f"the export does not read as this {kind} head for {target}: {error}"]
    architecture = read.layout.architecture
    state = head.state_dict()
    for name, tensor in read.unread.items():
        if not name.endswith(".bias"):
            causes.append(f"the export holds {name}, which vLLM's {architecture} has no parameter for: vLLM refuses "
                          "to load it")
        elif name in state and bool(state[name].ne(0).any()):  # the engine adds it, vLLM does not
            causes.append(f"the export holds {name}, which vLLM's {architecture} has no parameter for: vLLM's "
                          "weight loader drops an unexpected bias silently, so vLLM drafts without it and the engine "
                          f"with the head's (nonzero, max |b| {state[name].abs().max().item():.3g}); train without it "
                          "(--model.init_args.fc_bias false) to serve the head with vLLM")
    causes += fused_layer_causes(head, read.head, read.layout.format.captures_sorted)
    ours, theirs = head.config.to_dict(), read.head.config.to_dict()
    differing = [key for key in sorted(ours.keys() | theirs.keys())
                 if key not in NOT_COMPARED | {FUSED_LAYERS.get(kind), "rope_theta", "rope_scaling"}
                 and ours.get(key) != theirs.get(key)]
    if differing:
        causes.append("the export's config.json reads as other settings than the head's: " + "; ".join(
            f"{key} {theirs.get(key)!r} in the export, {ours.get(key)!r} in the head" for key in differing))
    exported_rope, head_rope = rope_settings(read.config), (head.config.rope_theta, head.config.rope_scaling)
    if exported_rope != head_rope:
        causes.append(f"the export's {describe_rope(exported_rope)} against the head's {describe_rope(head_rope)} "
                      "(its target's): vLLM's draft layer rotates by the export's")
    if not differing:
        causes += weight_causes(head, read.head, named=set(read.unread))
    return causes


def target_causes(target: Path, served_target: Path) -> list[str]:
    """The target vLLM serves against the engine's: rope first (a config.json edit the fingerprint does not see),
    then the fingerprint (architecture, sizes, vocabulary)."""
    from serving.targets import fingerprint

    ours, theirs = read_config(target), read_config(served_target)
    if rope_settings(ours) != rope_settings(theirs):
        return [f"vLLM serves the target {served_target} with {describe_rope(rope_settings(theirs))}, the engine ran "
                f"{target} with {describe_rope(rope_settings(ours))}: serve the target the head was trained on"]
    a, b = fingerprint(target), fingerprint(served_target)
    differing = [key for key in sorted(a) if key != "id" and a[key] != b.get(key)]
    if differing:
        return [f"vLLM serves another target ({served_target}) than the engine ran ({target}): "
                + "; ".join(f"{key} {b.get(key)!r} vs {a[key]!r}" for key in differing)]
    return []


def fused_layer_causes(head, served, captures_sorted: bool) -> list[str]:
    """fc's column blocks as vLLM feeds them (the export's layer ids ascending where its engine captures them so,
    else as listed) against the blocks the head trained on each layer."""
    kind = head.config.kind
    ours, listed = fused_layers(kind, head.config), fused_layers(kind, served.config)
    if not ours:
        return []
    fed = sorted(set(listed)) if captures_sorted else list(listed)
    if len(set(ours)) != len(ours) or len(fed) != len(listed):
        return []  # a layer named twice: its blocks are summed (formats.sorted_aux), nothing to match block by block
    if set(fed) != set(ours):
        return [f"the export names target layers {list(listed)}, the head was trained on {list(ours)}"]
    our_blocks = dict(zip(ours, head.fc.weight.detach().float().chunk(len(ours), dim=1)))
    their_blocks = served.fc.weight.detach().float().chunk(len(fed), dim=1)
    misfed = []
    for layer, block in zip(fed, their_blocks):
        if torch.allclose(block, our_blocks[layer], atol=ATOL):
            continue
        trained = [other for other, ours_block in our_blocks.items() if torch.allclose(block, ours_block, atol=ATOL)]
        if trained:
            misfed.append(f"the block trained on layer {trained[0]} reads layer {layer}")
    if not misfed:
        return []
    order = "ascending" if captures_sorted else "as listed"
    return [f"aux layer order: vLLM captures the export's layer ids {list(listed)} {order} ({fed}) and feeds fc's "
            f"column blocks in that order, but {', '.join(misfed)}: export with `draftheads export --format vllm`, "
            "which orders fc's blocks as vLLM captures them"]


def weight_causes(head, served, named: set[str]) -> list[str]:
    """The export's tensors as read against the head's. Those in the fused layers' order (fc's blocks, EAGLE 3.1's
    input norms, P-EAGLE's mask_hidden) are compared block by block above where the export lists the layers in
    another order. A head's tensor missing from what the export reads is named unless the file holds it under the
    same name (`named`: the tensors it holds that vLLM drops, named already)."""
    kind = head.config.kind
    ours, theirs = head.state_dict(), served.state_dict()
    reordered = fused_layers(kind, head.config) != fused_layers(kind, served.config)
    differing = [name for name in sorted(ours.keys() & theirs.keys())
                 if not (reordered and name.startswith(FUSED_TENSORS)) and ours[name].shape == theirs[name].shape
                 and not same(ours[name], theirs[name])]
    causes = [f"the head's {name} (nonzero) is not in the export: vLLM drafts without it"
              for name in sorted(ours.keys() - theirs.keys() - named) if ours[name].is_floating_point() and bool(ours[name].ne(0).any())]
    if differing:
        causes.append(f"the export's {', '.join(differing)} differ from the head's: it was exported from another head, "
                      "or edited since")
    return causes


def head_causes(head_config: dict, target: Path) -> list[str]:
    """Why the engine may accept less than the fit measured: the head folder's config.json (`head_config`) against
    the settings its fit recorded, and its rope against the target's now."""
    kind = head_config["kind"]
    training = head_config.get("metadata", {}).get("training", {})
    hparams = training.get("hparams", {})
    causes = []
    field = FUSED_LAYERS.get(kind)
    if field is not None:
        trained = hparams.get(field)
        if trained is None and training.get("store") and Path(training["store"]).is_dir():
            from training.data.store import Store

            trained = list(Store(training["store"]).aux_layers) if field == "aux_layers" else None
        if trained is not None and list(trained) != list(head_config[field]):
            causes.append(f"the head's config.json fuses {field} {list(head_config[field])}, its fit trained on "
                          f"{list(trained)}: the engine feeds fc's blocks in the config's order (restore "
                          f"{field}: {list(trained)})")
    for key, value in sorted(hparams.items()):
        if key != field and key in head_config and value is not None and value != head_config[key]:
            causes.append(f"the head's config.json says {key}: {head_config[key]!r}, its fit trained with {value!r}")
    head_rope = (float(head_config.get("rope_theta", 10000.0)), head_config.get("rope_scaling"))
    target_rope = rope_settings(read_config(target))
    if head_rope != target_rope:
        causes.append(f"the target {target} has {describe_rope(target_rope)} now, the head was trained with "
                      f"{describe_rope(head_rope)}")
    return causes
