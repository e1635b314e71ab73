"""`draftheads fit` and `draftheads validate`: LightningCLI over a draft-head module (model: class_path of one of
training.modules' MedusaModule, EagleModule, Eagle3Module, MtpModule, DFlashModule, DSparkModule), the store's
data module (data) and the Trainer (trainer), configured by YAML (configs/medusa.yaml, eagle.yaml, eagle3.yaml,
mtp.yaml, dflash.yaml, dspark.yaml)
and overridden on the command line:

    draftheads fit -c configs/eagle.yaml --data.store data/store --trainer.max_epochs 3
    draftheads fit -c configs/eagle.yaml --ckpt_path runs/eagle/checkpoints/last.ckpt     # resume
    draftheads validate -c configs/eagle.yaml --ckpt_path runs/eagle/checkpoints/last.ckpt

The model's target is the data's too (the store must come from it). Weights & Biases logs offline unless
WANDB_MODE says otherwise (WANDB_MODE=online syncs, or `wandb sync` the run folder later).
"""
from __future__ import annotations

import difflib
import inspect
import os
import re
import warnings

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from training.data.datamodule import DraftDataModule
from training.modules import MODULES, DraftModule

COMMANDS = ("fit", "validate")


# how jsonargparse says that a head module does not take a key, buried in its listing of the model's union types
UNKNOWN_OPTION = re.compile(r"class_path '(?:[\w.]+\.)?(\w+)':\s+Option '(\w+)' is not accepted")


def module_options(module: type) -> list[str]:
    """The keys a head module takes under model.init_args: its __init__'s parameters and its bases'."""
    names = []
    for cls in inspect.getmro(module):
        if "__init__" in cls.__dict__ and cls is not object:
            names += [p.name for p in inspect.signature(cls.__init__).parameters.values()
                      if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return list(dict.fromkeys(names))


class DraftParser(LightningArgumentParser):
    def parse_object(self, cfg_obj, *args, **kwargs):
        """LightningCLI parses the module settings of a checkpoint file it resumes from (as {subcommand: {"model":
        {"class_path", "dict_kwargs"}}}); one written before k was named num_speculative_tokens names it
        num_draft_tokens."""
        commands = cfg_obj.values() if isinstance(cfg_obj, dict) else ()
        for settings in (command.get("model", {}).get("dict_kwargs", {}) for command in commands
                         if isinstance(command, dict)):
            if "num_draft_tokens" in settings:
                settings["num_speculative_tokens"] = settings.pop("num_draft_tokens")
        return super().parse_object(cfg_obj, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        unknown = UNKNOWN_OPTION.search(message)
        modules = {cls.__name__: cls for cls in MODULES.values()}
        if unknown and unknown.group(1) in modules:
            name, key = unknown.groups()
            known = module_options(modules[name])
            close = difflib.get_close_matches(key, known, n=1)
            message += (f"\nmodel.init_args.{key} is not a setting of {name}"
                        + (f": did you mean model.init_args.{close[0]}?" if close else
                           f"; it takes {', '.join(known)} (--model.help training.modules.{name} explains them)"))
        elif 'Parser key "model"' in message:
            kinds = ", ".join(f"training.modules.{cls.__name__} ({kind})" for kind, cls in MODULES.items())
            message += f"\nmodel.class_path names the head kind to train: one of {kinds}"
        super().error(message, ex)


class DraftCLI(LightningCLI):
    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs) -> LightningArgumentParser:
        from training.cli import EXAMPLES

        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand in EXAMPLES:  # draftheads runs fit and validate only
            parser.epilog = f"example: {EXAMPLES[subcommand]}"
        return parser

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.target", "data.target")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            # jsonargparse wraps what a head module's __init__ refuses in a listing of the model's union types
            cause = error.__cause__
            if str(error).startswith("Does not validate against any of the Union subtypes") and isinstance(
                    cause, (ValueError, FileNotFoundError)):
                raise cause from None
            raise


def build_cli(args: list[str], run: bool = True) -> DraftCLI:
    os.environ.setdefault("WANDB_MODE", "offline")
    # `draftheads fit ...` hands its own argv on as args, which LightningCLI would warn about.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return DraftCLI(DraftModule, DraftDataModule, subclass_mode_model=True, args=args, run=run, parser_class=DraftParser,
                    auto_configure_optimizers=False, save_config_kwargs={"overwrite": True})


def main(command: str, argv: list[str]) -> int:
    if command not in COMMANDS:
        raise ValueError(f"training.fit runs {' and '.join(COMMANDS)}, not {command!r}")
    try:
        build_cli([command, *argv])
    finally:
        import wandb

        if wandb.run is not None:  # one wandb run per fit, also when several fits share a process
            wandb.finish()
    return 0
