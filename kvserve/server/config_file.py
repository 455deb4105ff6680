"""`--config FILE.yaml`: the same keys as the flags (`max-model-len: 4096` or `max_model_len: 4096`);
anything given on the command line wins, wherever --config appears on it.

To know what the command line gave, every option's action records its destination when argparse runs it
(`track_explicit_options`); config values are then parsed, as flags, only for the options it did not give, so
types and choices are checked exactly as on the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

EXPLICIT_ATTR = "_explicit_options"


class ConfigFileError(ValueError):
    pass


def track_explicit_options(parser: argparse.ArgumentParser) -> None:
    """Makes each option of `parser` note its dest in the namespace when the command line sets it."""
    for action in parser._actions:
        if action.dest in ("help", argparse.SUPPRESS) or not action.option_strings:
            continue
        action.__class__ = _tracking_class(type(action))


_TRACKING_CLASSES: dict[type, type] = {}


def _tracking_class(action_class: type) -> type:
    if getattr(action_class, "_tracks_explicit", False):
        return action_class
    if action_class not in _TRACKING_CLASSES:
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: N807
            explicit = getattr(namespace, EXPLICIT_ATTR, None)
            if explicit is None:
                explicit = set()
                setattr(namespace, EXPLICIT_ATTR, explicit)
            explicit.add(self.dest)
            action_class.__call__(self, parser, namespace, values, option_string)

        _TRACKING_CLASSES[action_class] = type(
            f"Tracked{action_class.__name__}", (action_class,), {"__call__": __call__, "_tracks_explicit": True}
        )
    return _TRACKING_CLASSES[action_class]


def load_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of option names to values")
    return data


def apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, path: str) -> None:
    """Sets, on `args`, every option from the file that the command line did not give."""
    explicit: set[str] = getattr(args, EXPLICIT_ATTR, set())
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    for key, value in load_config_file(path).items():
        option = "--" + str(key).replace("_", "-")
        action = options.get(option)
        if action is None or option == "--config" or action.dest == "help":
            raise ConfigFileError(f"--config {path}: unknown option {key!r} (use the flag names of `kvserve serve`)")
        if action.dest not in explicit:
            argv.extend(_as_flags(option, value, action, path))
    if argv:
        try:
            parser.parse_args(argv, namespace=args)
        except SystemExit:
            raise ConfigFileError(f"--config {path}: invalid value (see the message above)") from None


def _as_flags(option: str, value: Any, action: argparse.Action, path: str) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {option[2:]} must be true or false, got {value!r}")
        return [option if value else "--no-" + option[2:]]
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {option[2:]} must be true or false, got {value!r}")
        return [option] if value == bool(action.const) else []  # const: True for store_true, False for store_false
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [option, *(str(v) for v in values)]
