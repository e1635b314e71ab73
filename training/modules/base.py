"""What every draft-head LightningModule shares: the frozen target, the per-position validation metrics, the token
loss of a draft position (`loss`, losses.py: self.draft_loss) and the optimizer. Each head kind (medusa.py, eagle.py,
eagle3.py, mtp.py, peagle.py, dflash.py) adds its model and its loss: which rows each draft position trains on, the
target's distribution there, and the per-position weighting.

The frozen target is the embedding, final norm and LM head read from the target's safetensors
(heads.load_target_parts), and, only when the data module runs online, the whole target (serving.model.Model)
that turns a batch's token ids into hidden states. Neither is a submodule: they follow the module across devices
and dtypes but never enter its state_dict, its checkpoints or its optimizer, which hold the head alone.

Validation simulates chain drafting of `num_speculative_tokens` drafts (k, as the engine's option of that name)
against the target's own next tokens, the way the engine drafts (for feature heads the layer is unrolled over its
own outputs, see unroll.py), and logs the conditional accuracy per position (val/acc_1..k), the mean acceptance length tau it implies (val/tau), and tau with
chains started where the engine starts them (val/tau_walk); see chain_accuracy.py. With a token map
(`draftheads token-map`), Medusa, EAGLE-1 and MTP heads train to draft among its tokens over those rows of the LM head, as the
engine serves them with the same file: the LM head, by far the largest cost of a training step, shrinks to the
map's rows; labels outside the map are left out of the loss and count as misses in validation. Optimization is
AdamW with linear warmup and cosine or linear decay, stepped every optimizer step; gradient clipping and precision
are Trainer settings.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields
from functools import partial
from typing import ClassVar

import torch
from lightning.pytorch import LightningModule
from torch.optim.lr_scheduler import LambdaLR

import heads
from heads import load_target_parts
from heads.attention import DenseCausalAttention
from heads.token_map import lm_head_rows, load_token_map
from serving import targets
from serving.config import DTYPES
from serving.spec_decode.config import TAKES_TOKEN_MAP
from training.data.store import HIDDEN_DTYPE
from training.modules.calibration import Calibration
from training.modules.chain_accuracy import ChainAccuracy, reached
from training.modules.losses import DraftLoss
from training.modules.schedule import SCHEDULES, lr_factor
from training.modules.unroll import shift_left

CHECKPOINT_KEY = "draft_head"
FITTED = ("metadata", "confidence_temperatures")  # config fields a fit writes, not settings a resume must match


class DraftModule(LightningModule):
    kind: ClassVar[str] = ""
    hidden_layers: ClassVar[tuple[str, ...]] = ("last",)  # the store's hidden states this kind reads
    default_loss: ClassVar[str] = "kl"  # the token loss when `loss` is null

    def __init__(self, target: str = targets.DEFAULT_TARGET, num_speculative_tokens: int = 4,
                 learning_rate: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 100,
                 schedule: str = "cosine", min_lr_ratio: float = 0.1, target_dtype: str = "float32",
                 token_map: str | None = None, prompt_loss: bool = False, init_from: str | None = None,
                 loss: str | dict[str, float] | None = None, lk_eta: float = 3.0):
        """Settings every head kind shares.

        Args:
            target: The frozen target: a built-in name, a Hugging Face folder, or a hub id when online.
            num_speculative_tokens: k, the drafts of the chain validation simulates (val/acc_1..k, val/tau): the
                engine's num_speculative_tokens.
            learning_rate: Peak learning rate of AdamW.
            weight_decay: AdamW weight decay of matrices (norms and biases get none).
            betas: AdamW betas.
            warmup_steps: Optimizer steps of linear warmup from 0 to the peak learning rate.
            schedule: Decay after warmup: cosine, linear or constant.
            min_lr_ratio: The learning rate decays to this fraction of the peak by the last step.
            target_dtype: Dtype of the frozen target pieces (float32, bfloat16 or float16).
            token_map: A token map file (`draftheads token-map`) to draft among (Medusa, EAGLE-1, MTP); the head
                keeps it and drafts among it when served. null: the whole vocabulary.
            prompt_loss: Also train at prompt tokens, each labelled by the target's greedy token after the tokens
                before it (loss_labels): more positions from the same store, worth it for EAGLE and MTP heads.
            init_from: A head folder (runs/<kind>/heads/best, or `draftheads import`'s) whose weights the fit starts
                from; it must be of this kind, for this target, with these settings' shapes (and token map).
            loss: The token loss of every draft position (losses.py): ce (cross-entropy against the label), kl (to
                the target's distribution), tv (total variation, 1 - the acceptance rate), lk_hybrid (KL and TV
                blended by the acceptance rate), or a mix such as {kl: 0.5, tv: 0.5}. null: the kind's default
                (Medusa and MTP ce, EAGLE-1 and EAGLE-3 kl).
            lk_eta: eta of lk_hybrid's weight lambda = exp(-eta * acceptance rate) on KL (the paper's 3).
        """
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")
        if target_dtype not in DTYPES:
            raise ValueError(f"target_dtype={target_dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        self.save_hyperparameters()
        self.draft_loss = DraftLoss.parse(self.default_loss if loss is None else loss, lk_eta)
        self.target_folder = targets.resolve(target)
        self.target_fingerprint = targets.fingerprint(self.target_folder)
        parts = load_target_parts(self.target_folder, DTYPES[target_dtype], fingerprint=self.target_fingerprint)
        ids = None
        if token_map:
            if self.kind not in TAKES_TOKEN_MAP:
                raise ValueError(f"token_map applies to {', '.join(TAKES_TOKEN_MAP)} heads, not {self.kind}"
                                 + (": EAGLE-3 trains over its own draft vocabulary (draft_vocab_size)"
                                    if self.kind in ("eagle3", "peagle") else ""))
            ids = load_token_map(token_map, parts.vocab_size)
            parts.lm_head = lm_head_rows(parts.lm_head, ids)
        # target id -> index in the token map, -1 outside it; empty without a map. Buffers outside the state dict.
        self.register_buffer("token_map_ids", ids, persistent=False)
        self.register_buffer("token_map_index", None if ids is None else torch.full((parts.vocab_size,), -1).index_copy_(
            0, ids, torch.arange(len(ids))), persistent=False)
        object.__setattr__(self, "target_parts", parts)  # frozen, never a submodule
        object.__setattr__(self, "target_model", None)  # the whole target, loaded for online data only
        self.chain = ChainAccuracy(num_speculative_tokens)
        self.calibration = Calibration(num_speculative_tokens)
        self.val_accuracy: list[float] = []
        self.has_init_weights = False  # init_from is copied in once, at the first setup

    # ---- what each kind defines -----------------------------------------------------------------------

    def training_loss(self, batch: dict, hidden: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, named terms to log) on a batch; hidden: the store's layers as [B, S, width] in the module's dtype."""
        raise NotImplementedError

    def validation_outputs(self, batch: dict, hidden: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """(loss, correct [B, S, k], valid [B, S, k], logits) of the simulated chain at every anchor; logits[i]:
        [N_i, vocab] the head's logits for draft i+1 at the anchors where valid[..., i] holds, in [B, S] order."""
        raise NotImplementedError

    def use_store(self, store) -> None:
        """Fit the head to the training store (e.g. EAGLE-3's draft vocabulary) and check it can train on it."""

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose inputs the kind reads as hidden["eagle3"] (EAGLE-3's aux layers); none by default."""
        return ()

    def draft_labels(self, labels: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels as LM-head rows, valid and inside the token map); unchanged without a map."""
        if self.token_map_index is None:
            return labels, valid
        rows = self.token_map_index[labels]
        return rows.clamp(min=0), valid & (rows >= 0)

    def target_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """LM-head rows (argmax of the head's logits) as target token ids."""
        return rows if self.token_map_ids is None else self.token_map_ids[rows]

    @torch.no_grad()
    def loss_labels(self, batch: dict, last: torch.Tensor, rows: torch.Tensor | None = None,
                    to_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [B, S], has_label [B, S]): the token the training loss teaches the head to draft at each
        position. An answer token labels itself. With prompt_loss a prompt token (after the first) is a label too:
        the target's greedy token after the tokens before it, i.e. the argmax of LM-head `rows` (default: the rows
        the head drafts from; to_ids maps a row to its token id) at the previous position's last hidden state.
        A prompt's own next token is someone else's choice, but the target's features and distribution over the
        prompt are its own: on a store of a few hundred answers this nearly doubles the positions to learn from."""
        ids, answer = batch["input_ids"], batch["loss_mask"]
        if not self.hparams.prompt_loss:
            return ids, answer
        prompt = batch["padding_mask"] & ~answer
        prompt[:, 0] = False
        before = last[:, :-1][prompt[:, 1:]]
        greedy = (self.target_parts.lm_head(before) if rows is None else before @ rows.to(before.dtype).T).argmax(-1)
        labels = ids.clone()
        labels[prompt] = (to_ids or self.target_ids)(greedy)
        return labels, answer | prompt

    # ---- the frozen target ----------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        store = getattr(datamodule, "store", None)
        if store is not None:
            self.use_store(store)
        if self.hparams.init_from and not self.has_init_weights:
            self.start_from(self.hparams.init_from)
        if getattr(datamodule, "mode", "offline") == "online" and self.target_model is None:
            from serving.model import Model

            # Built where Lightning is about to move this module: the CPU kernels' layers cannot move once packed.
            device = self.trainer.strategy.root_device
            model = Model.from_folder(self.target_folder, DTYPES[self.hparams.target_dtype], device)
            object.__setattr__(self, "target_model", model)

    def start_from(self, folder) -> None:
        """Copy the head saved in `folder` into this module's head, refusing one of another kind, target or shape.
        A resumed run then loads its checkpoint over it (Lightning restores checkpoints after setup)."""
        where = f"init_from {folder}"
        try:
            saved = heads.load(folder, self.target_fingerprint)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if saved.config.kind != self.kind:
            self.start_from_kind(saved, where)
            self.has_init_weights = True
            return
        differences = config_differences(self.head.config.to_dict(), saved.config.to_dict(), "folder")
        if differences:
            raise ValueError(f"{where} holds a {self.kind} head whose settings differ from this config's: "
                             f"{'; '.join(differences)}. Set the model's settings to the folder's to start from it")
        if saved.token_map is not None and not torch.equal(saved.token_map, self.head.token_map.cpu()):
            raise ValueError(f"{where} drafts over another token map than {self.hparams.token_map}: train with the "
                             "token map file it was trained with")
        self.head.load_state_dict(saved.state_dict())
        self.has_init_weights = True

    def start_from_kind(self, saved, where: str) -> None:
        """Start from `saved`, a head of another kind than this module's: refused, unless a kind warm-starts from it."""
        raise ValueError(f"{where} holds a head of kind {saved.config.kind}, but this config trains kind {self.kind} "
                         f"({type(self).__name__}): start from a head of kind {self.kind}")

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        for frozen in (self.target_parts, self.target_model):
            if frozen is not None:
                frozen._apply(fn, *args, **kwargs)
        return self

    def hidden_states(self, batch: dict) -> dict[str, torch.Tensor]:
        """The batch's hidden states ([B, S, width] per layer) in the module's dtype: the store's, or (online) the
        target's own, rounded to bfloat16 as the store holds them."""
        hidden = batch.get("hidden")
        if hidden is None:
            hidden = self.target_hidden(batch)
        return {name: states.to(self.dtype) for name, states in hidden.items()}

    @torch.no_grad()
    def target_hidden(self, batch: dict) -> dict[str, torch.Tensor]:
        """Runs the whole target over the batch's [B, S] token ids, flattened as the model expects, with dense
        causal attention per sequence."""
        model = self.target_model
        if model is None:
            raise RuntimeError("the batch carries no hidden states and no target is loaded: run with a data module "
                               "in mode 'online', or give batches from a store (mode 'offline')")
        input_ids = batch["input_ids"]
        batch_size, num_positions = input_ids.shape
        if model.rope.cos.device != input_ids.device:
            model.rope.to(torch.float32, input_ids.device)
        dense = DenseCausalAttention(batch["padding_mask"])

        def attention(layer_idx, q, k, v):  # [B * S, heads, head_dim] each
            out = dense(layer_idx, *(x.view(batch_size, num_positions, *x.shape[1:]) for x in (q, k, v)))
            return out.flatten(0, 1)

        aux_layers = self.aux_layers
        positions = torch.arange(num_positions, device=input_ids.device).repeat(batch_size)
        out = model(input_ids.flatten(), positions, attention, logits_rows=input_ids.new_zeros(0), return_hidden=True,
                    aux_layers=aux_layers)
        hidden = {"last": out.hidden}
        if aux_layers:
            hidden["eagle3"] = torch.cat([out.aux[layer] for layer in aux_layers], dim=-1)
        return {name: states.view(batch_size, num_positions, -1).to(HIDDEN_DTYPE, copy=True)
                for name, states in hidden.items()}

    # ---- steps ----------------------------------------------------------------------------------------

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, terms = self.training_loss(batch, self.hidden_states(batch))
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{name}": value for name, value in terms.items()}, batch_size=batch_size)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], batch_size=batch_size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, correct, valid, logits = self.validation_outputs(batch, self.hidden_states(batch))
        self.chain.update(correct, valid)
        on_chain = reached(correct, valid)
        for i, rows in enumerate(logits):
            self.calibration.update(i, rows[on_chain[..., i][valid[..., i]]], correct[..., i][on_chain[..., i]])
        self.log("val/loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])

    def on_validation_epoch_end(self) -> None:
        result = self.chain.compute()
        self.chain.reset()
        self.val_accuracy = result["accuracy"].tolist()
        for position, accuracy in enumerate(result["accuracy"], start=1):
            self.log(f"val/acc_{position}", accuracy)
        self.log("val/tau", result["tau"], prog_bar=True)
        self.log("val/tau_walk", result["tau_walk"])
        self.head.config.confidence_temperatures = self.calibration.compute()
        self.calibration.reset()
        for position, temperature in enumerate(self.head.config.confidence_temperatures, start=1):
            self.log(f"val/temperature_{position}", temperature)

    def chain_outcomes(self, batch: dict, outs, logits, to_ids) -> tuple[torch.Tensor, torch.Tensor, list]:
        """outs[s]: [B, S, ...] what drafts token s+1 at each anchor; logits(s, rows) -> [N, vocab] the head's
        logits there; to_ids: their argmax as target ids. Returns validation_outputs' (correct, valid, logits):
        draft s+1 at anchor t is judged against x_{t+s+2}."""
        correct, valid, drafted = [], [], []
        for s, out in enumerate(outs):
            is_answer = shift_left(batch["loss_mask"], s + 2)  # [B, S]
            right = torch.zeros_like(is_answer)
            rows = logits(s, out[is_answer])
            right[is_answer] = to_ids(rows.argmax(-1)) == shift_left(batch["input_ids"], s + 2)[is_answer]
            correct.append(right)
            valid.append(is_answer)
            drafted.append(rows)
        return torch.stack(correct, -1), torch.stack(valid, -1), drafted

    # ---- optimizer ------------------------------------------------------------------------------------

    def configure_optimizers(self):
        p = self.hparams
        params = [param for param in self.head.parameters() if param.requires_grad]
        groups = [{"params": [x for x in params if x.ndim >= 2], "weight_decay": p.weight_decay},
                  {"params": [x for x in params if x.ndim < 2], "weight_decay": 0.0}]  # norms and biases
        optimizer = torch.optim.AdamW(groups, lr=p.learning_rate, betas=tuple(p.betas))
        num_steps = self.trainer.estimated_stepping_batches
        if math.isinf(num_steps):
            if p.schedule != "constant":
                raise ValueError(f"a {p.schedule} schedule needs a known length: set trainer.max_steps or "
                                 "trainer.max_epochs, or use schedule: constant")
            num_steps = 0  # a constant schedule never reads it
        factor = partial(lr_factor, num_warmup_steps=p.warmup_steps, num_training_steps=int(num_steps),
                         schedule=p.schedule, min_lr_ratio=p.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, factor), "interval": "step"}}

    # ---- checkpoints ----------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = {"kind": self.kind, "config": self.head.config.to_dict()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        path = self._trainer.ckpt_path if self._trainer is not None else None
        where = f"checkpoint {path}" if path else "the checkpoint"
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            raise ValueError(f"{where} was not written by a draftheads fit run (it has no '{CHECKPOINT_KEY}' entry): "
                             "pass a checkpoint from `draftheads fit`")
        if saved["kind"] != self.kind:
            raise ValueError(f"{where} holds head kind {saved['kind']}, but this config trains kind "
                             f"{self.kind} ({type(self).__name__}): resume with the config the checkpoint was trained with, "
                             "or pass a checkpoint of this kind")
        # a field added since the checkpoint was written reads as its default there
        defaults = {f.name: f.default for f in fields(self.head.config) if f.default is not MISSING}
        differences = config_differences(self.head.config.to_dict(), {**defaults, **saved["config"]}, "checkpoint")
        if differences:
            raise ValueError(f"{where} holds a head of kind {self.kind} that differs from this config's: "
                             f"{'; '.join(differences)}. Resume with the settings (and target) it was trained with")
        saved_map = checkpoint["state_dict"].get("head.token_map")
        if saved_map is not None and not torch.equal(saved_map.cpu(), self.head.token_map.cpu()):
            raise ValueError(f"{where} was trained over another token map than {self.hparams.token_map}: resume with "
                             "the token map file it was trained with")


def config_differences(ours: dict, theirs: dict, label: str) -> list[str]:
    """'key: <label> theirs, config ours' for each head config field, but those a fit writes, where `theirs` differs
    from `ours`, compared as JSON stores them."""
    ours, theirs = json.loads(json.dumps(ours)), json.loads(json.dumps(theirs))
    return [f"{key}: {label} {theirs.get(key)!r}, config {ours.get(key)!r}" for key in sorted(ours.keys() | theirs.keys())
            if key not in FITTED and ours.get(key) != theirs.get(key)]

