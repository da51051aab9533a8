"""Settings dataclasses -> command-line flags, and YAML ``--config`` files read through the same
flags.

A settings class declares each field once with ``setting(default, help, ...)``; ``add_flags``
turns every field into a flag named after it (``max_num_seqs`` -> ``--max-num-seqs``, booleans as
``--x`` / ``--no-x``), plus any aliases. ``ArgParser`` records which destinations the command line
itself set, so a ``--config`` file fills in everything else: command line > file > defaults, even
when the command-line value equals the default.
"""

from __future__ import annotations

import argparse
import difflib
import typing
from collections.abc import Collection, Sequence
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

_GIVEN = "_flags_given"  # namespace attribute: the destinations the command line set


def setting(default: Any, help: str, *aliases: str, group: str = "engine",
            choices: Sequence[Any] | None = None, metavar: str | None = None,
            flag: str | None = None) -> Any:
    """A dataclass field that is also a flag. ``aliases`` are extra flag spellings (vLLM's names);
    ``group`` is the help section; ``flag`` replaces the flag named after the field."""
    meta = {"help": help, "aliases": aliases, "group": group, "choices": choices,
            "metavar": metavar, "flag": flag}
    return field(default=default, metadata=meta)


def flag_name(f: Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _scalar_type(hint: Any) -> Any:
    """``int | None`` -> int; ``str | int | None`` -> str (parsed later by the config)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if not args:
        return hint
    return str if str in args else args[0]


def add_flags(parser: argparse.ArgumentParser, cls: type, titles: dict[str, str],
              only: Collection[str] | None = None) -> None:
    """One flag per field of ``cls`` (``only``: of those fields), in argument groups titled by
    ``titles[field group]``."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta or (only is not None and f.name not in only):
            continue
        g = groups.get(meta["group"])
        if g is None:
            g = groups[meta["group"]] = parser.add_argument_group(titles[meta["group"]])
        typ = _scalar_type(hints[f.name])
        names = [flag_name(f), *meta["aliases"]]
        assert f.default is not MISSING, f"{cls.__name__}.{f.name} needs a default"
        if typ is bool:
            g.add_argument(*names, dest=f.name, default=f.default,
                           help=f"{meta['help']} (default: {'on' if f.default else 'off'})",
                           action=_recording(argparse.BooleanOptionalAction))
            continue
        shown = "" if f.default is None or "default" in meta["help"] else " (default: %(default)s)"
        metavar = meta["metavar"] or ("N" if typ is int and meta["choices"] is None else None)
        g.add_argument(*names, dest=f.name, default=f.default, type=typ,
                       choices=meta["choices"], metavar=metavar, help=meta["help"] + shown)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """The settings object of the flags ``add_flags(parser, cls)`` put into ``ns``."""
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})  # type: ignore[arg-type]


def check_names(cls: type, names: Sequence[str], aliases: dict[str, str], what: str) -> None:
    """Raise TypeError naming the closest field for a keyword ``cls`` does not have."""
    known = {f.name for f in fields(cls)} | set(aliases)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{what} got an unknown setting {name!r}{hint} "
                            f"(the settings are the fields of pagedllm.{cls.__name__})")


def given(ns: argparse.Namespace) -> set[str]:
    """Destinations set on the command line (recorded by ``ArgParser``'s actions)."""
    found: set[str] = ns.__dict__.setdefault(_GIVEN, set())
    return found


_RECORDING: dict[type, type] = {}


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    """``base`` that also notes its destination as given on the command line."""
    cls = _RECORDING.get(base)
    if cls is None:
        def __call__(self: argparse.Action, parser: argparse.ArgumentParser,
                     namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            if self.option_strings:  # an absent optional positional is "called" with its default
                given(namespace).add(self.dest)
            base.__call__(self, parser, namespace, values, option_string)

        cls = _RECORDING[base] = type("Recording" + base.__name__, (base,), {"__call__": __call__})
    return cls


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags record that the command line gave them, and which applies
    ``--config FILE.yaml`` (where it defines ``--config``) after parsing. Subcommand parsers made
    with ``add_subparsers`` are ArgParsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, base in ((None, argparse._StoreAction), ("store", argparse._StoreAction),
                           ("store_const", argparse._StoreConstAction),
                           ("store_true", argparse._StoreTrueAction),
                           ("store_false", argparse._StoreFalseAction),
                           ("append", argparse._AppendAction)):
            self.register("action", name, _recording(base))

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        given(ns)
        if getattr(ns, "config", None) and any(a.dest == "config" for a in self._actions):
            apply_config_file(ns, self)
        return ns, rest


def _config_keys(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """YAML key (dashes as underscores) -> (action, key is a flag spelling). Keys are the flag
    names and the destinations."""
    keys: dict[str, tuple[argparse.Action, bool]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config", argparse.SUPPRESS):
            continue
        keys[action.dest] = (action, False)
        for opt in action.option_strings:
            if opt.startswith("--"):
                keys[opt[2:].replace("-", "_")] = (action, True)
    return keys


def _file_value(action: argparse.Action, key: str, value: Any, as_flag: bool, where: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false")
        return not value if key.replace("-", "_").startswith("no_") and as_flag else value
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false")
        if as_flag and key.replace("-", "_") != action.dest:  # `no-plot: true` means the flag
            return action.const if value else action.default
        return value
    if isinstance(action, argparse._AppendAction) or (action.nargs in ("+", "*")
                                                      and isinstance(value, list)):
        items = value if isinstance(value, list) else [value]
        return [_convert(action, key, v, where) for v in items]
    return _convert(action, key, value, where)


def _convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    if value is not None and action.type is not None and not isinstance(value, bool):
        try:
            value = action.type(value)  # type: ignore[operator]
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise ValueError(f"{where}: {key}={value!r} is not a valid value") from None
    if value is not None and action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {key}={value!r}; choose one of {list(action.choices)}")
    return value


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      ) -> argparse.Namespace:
    """Fill ``args`` from the YAML file ``args.config`` wherever the command line was silent.

    Keys are flag names or destinations, with dashes or underscores (``max-num-seqs``,
    ``max_num_seqs``, ``no-enable-prefix-caching: true``, ``enable_prefix_caching: false``,
    aliases such as ``num-gpu-blocks-override``).
    """
    path = getattr(args, "config", None)
    if not path:
        return args
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    keys = _config_keys(parser)
    cli = given(args)
    for key, value in data.items():
        hit = keys.get(str(key).replace("-", "_"))
        if hit is None:
            close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(keys), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}; use the flag names of "
                             f"`{parser.prog} --help`")
        action, as_flag = hit
        if action.dest not in cli:
            setattr(args, action.dest, _file_value(action, str(key), value, as_flag, path))
    return args


def parse_setting(cls: type, name: str, text: str, aliases: dict[str, str]) -> tuple[str, Any]:
    """(field name, value) of ``name=text`` (``block-size`` or ``block_size`` or an alias,
    ``"16"``), the text converted to the field's type as its flag would convert it. An unknown
    name is a ValueError naming the closest field."""
    key = name.strip().lstrip("-").replace("-", "_")
    key = aliases.get(key, key)
    flags = {f.name: f for f in fields(cls) if "help" in f.metadata}
    if key not in flags:
        close = difflib.get_close_matches(key, sorted(flags), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{name!r} is not a setting of {cls.__name__}{hint}")
    hint_type = typing.get_type_hints(cls)[key]
    typ, raw = _scalar_type(hint_type), text.strip()
    if raw.lower() in ("none", "null") and type(None) in typing.get_args(hint_type):
        return key, None
    if typ is bool:
        if raw.lower() not in ("true", "false", "on", "off", "1", "0"):
            raise ValueError(f"{key}={raw!r}: expected true or false")
        return key, raw.lower() in ("true", "on", "1")
    try:
        return key, typ(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={raw!r} is not a valid {typ.__name__}") from None
