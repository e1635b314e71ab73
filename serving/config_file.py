"""A command's options from a YAML file (`--config FILE`): its keys are the options' names, and an option given
on the command line overrides its key."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path

import yaml

CONFIG_HELP = "YAML file whose keys are these options' names; options given on the command line override it"


def merge_options(options: dict, known) -> dict:
    """options: the command line's, absent where not given, and `config`, the YAML file's path or None ->
    the file's values, updated by the options given. Unknown keys in the file are refused, by name."""
    path = options.get("config")
    values = {}
    if path:
        try:
            values = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as error:
            raise ValueError(f"{path} is not valid YAML: {error}") from None
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ValueError(f"{path} must be a YAML mapping of option names to values")
        values = {str(key).replace("-", "_"): value for key, value in values.items()}
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    values.update({key: value for key, value in options.items() if key != "config"})
    return values


def add_options(parser: argparse.ArgumentParser, config_class, helps: dict, types: dict, extra: dict | None = None) -> None:
    """One --option per entry of `helps` (option name -> help): `config`, the YAML file, and the fields of
    `config_class`, whose defaults the help shows. Unset options stay absent from the parsed namespace, so that
    merge_options lets the file fill them. `types` and `extra` (more add_argument keywords) are per option."""
    defaults = {f.name: f.default for f in fields(config_class)}
    for name, help in helps.items():
        default = defaults.get(name, MISSING)
        if isinstance(default, tuple):
            default = ",".join(default)
        shown = "" if default is MISSING or default is None else f" (default: {default})"
        flags = ["-c", "--config"] if name == "config" else [f"--{name.replace('_', '-')}"]  # -c as fit's
        more = (extra or {}).get(name, {})
        is_flag = more.get("action") is argparse.BooleanOptionalAction  # a flag takes no value, so no type
        typed = {} if is_flag else {"type": types.get(name, str)}
        parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=help + shown, **typed, **more)
