"""Command-line flags from a config dataclass: the one way every service builds its CLI.

Each init field of the dataclass is one flag, ``redis_url`` -> ``--redis-url``, declared with
its help text by :func:`flag` (or, with ``positional=True``, one positional argument: a batch
job's input file). The dataclass stays the only source of defaults (a flag not
given is not passed, so the field's own default applies) and of validation (its
``__post_init__``; a ``ValueError`` there becomes an argparse error, exit status 2).

How a field's type reads from the command line:

    str, int, float          one value
    bool                     ``--x``, ``--x true`` or ``--x=false`` (1/0, yes/no, on/off too)
    X | None                 as X; not given = None
    an Enum                  one of its values (``--policy round-robin``)
    tuple[X, ...], list[X]   one comma-separated value (``--engines URL,URL``), or with
                             ``repeat=True`` the flag repeats, one item each (``--model M``),
                             and with ``many=True`` also takes several (``--lora-modules a=x
                             b=y``, as vLLM's nargs="+" flags)
    anything else            needs ``parse=``: a function from the text to the value

A launcher that hands the flags it does not know to its children (``services.serve`` passes
engine flags to every engine, as ``vllm serve`` does) parses with :func:`config_and_rest`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_METADATA_KEY = "pagoda.cli"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True, slots=True)
class FlagSpec:
    """How one field reads from the command line (``flag`` stores it in the field's metadata)."""

    help: str
    name: str | None = None  # the flag without "--"; None = the field name, "_" -> "-"
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text -> value (an item, for a tuple or list)
    repeat: bool = False  # a tuple or list: the flag repeats instead of taking commas
    positional: bool = False  # an argument without "--", required unless the field has a default
    many: bool = False  # with repeat: one flag may also take several items


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    name: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
    positional: bool = False,
    many: bool = False,
) -> Any:
    """A dataclass field that is also a flag: ``port: int = flag(8100, help="port to listen on")``.

    ``name`` spells the flag differently from the field (``--model`` for ``models``), where a
    repeatable flag names one item; the mapping stays one field, one flag."""
    spec = FlagSpec(help, name, metavar, parse, repeat, positional, many)
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_METADATA_KEY: spec}
    )


def option(field: dataclasses.Field) -> str:
    """The flag of a field: ``--redis-url`` for ``redis_url`` (a positional one: ``input``)."""
    spec = field.metadata.get(_METADATA_KEY)
    if spec is not None and spec.positional:
        return field.name
    name = spec.name if spec is not None and spec.name else field.name.replace("_", "-")
    return "--" + name


def build_parser(
    *config_classes: type, prog: str, description: str, epilog: str | None = None,
    allow_abbrev: bool = True,
) -> argparse.ArgumentParser:
    """A parser with one flag per init field of each class (their field names must differ)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, allow_abbrev=allow_abbrev
    )
    for config_cls in config_classes:
        add_arguments(parser, config_cls)
    return parser


def add_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Adds one flag per init field of ``config_cls``; a field not declared by ``flag`` (so
    without help) or of a type with no reader is a ``TypeError``."""
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if not field.init:
            continue
        spec = field.metadata.get(_METADATA_KEY)
        if spec is None:
            raise TypeError(f"{config_cls.__name__}.{field.name}: declare it with cli.flag(...)")
        where = f"{config_cls.__name__}.{field.name}"
        kwargs = _reader(hints[field.name], spec, where)
        if spec.positional:  # argparse takes its dest from the name
            if _has_default(field):
                kwargs["nargs"] = "?"
            parser.add_argument(field.name, default=argparse.SUPPRESS,
                                help=_help(spec, field), **kwargs)
            continue
        parser.add_argument(
            option(field),
            dest=field.name,
            default=argparse.SUPPRESS,  # not given: the dataclass's default applies
            help=_help(spec, field),
            **kwargs,
        )


def from_namespace(
    config_cls: type[T],
    ns: argparse.Namespace,
    parser: argparse.ArgumentParser,
    **overrides: Any,
) -> T:
    """The config from the flags given in ``ns`` (and ``overrides``, which win); a
    ``ValueError`` from its validation exits through ``parser.error``."""
    fields = [f for f in dataclasses.fields(config_cls) if f.init]
    given = {f.name: getattr(ns, f.name) for f in fields if hasattr(ns, f.name)}
    try:
        return config_cls(**{**given, **overrides})
    except ValueError as exc:
        parser.error(_name_flag(str(exc), {f.name: option(f) for f in fields}))


def config_from_args(
    config_cls: type[T], argv: Sequence[str] | None = None, *, prog: str, description: str
) -> T:
    """Parses ``argv`` (default: ``sys.argv[1:]``) into ``config_cls``; exits 2 on a bad flag."""
    parser = build_parser(config_cls, prog=prog, description=description)
    return from_namespace(config_cls, parser.parse_args(argv), parser)


def config_and_rest(
    config_cls: type[T], argv: Sequence[str] | None = None, *, prog: str, description: str,
    epilog: str | None = None,
) -> tuple[T, list[str]]:
    """As ``config_from_args``, but the arguments ``config_cls`` has no flag for are returned,
    in order, instead of refused: a launcher passes them on to its children. Flags must be
    spelled out (no abbreviations): ``--engine`` must not become ``--engines``."""
    parser = build_parser(config_cls, prog=prog, description=description, epilog=epilog,
                          allow_abbrev=False)
    ns, rest = parser.parse_known_args(argv)
    return from_namespace(config_cls, ns, parser), rest


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# -- a field's type -> argparse keywords -------------------------------------------------------


def _reader(hint: Any, spec: FlagSpec, where: str) -> dict[str, Any]:
    hint = _without_none(hint)
    container = typing.get_origin(hint)
    if container in (tuple, list):
        item = _item_type(hint, where)
        parse = _item_parser(item, spec, where)
        metavar = spec.metavar or _metavar(item)
        if spec.repeat:
            many = {"nargs": "+"} if spec.many else {}
            return {"action": _Append, "type": parse, "metavar": metavar, "collection": container,
                    **many}
        return {"type": _comma_separated(parse, container), "metavar": metavar + ",..."}
    if spec.repeat:
        raise TypeError(f"{where}: repeat=True needs a tuple or list field")
    if hint is bool and spec.parse is None:
        return {"type": parse_bool, "nargs": "?", "const": True, "metavar": spec.metavar or "BOOL"}
    kwargs = {"type": _item_parser(hint, spec, where)}
    if spec.metavar or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        kwargs["metavar"] = spec.metavar or _metavar(hint)
    return kwargs


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _item_type(hint: Any, where: str) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: only tuple[X, ...] reads from a flag, not {hint}")
        return args[0]
    return args[0] if args else str


def _item_parser(item: Any, spec: FlagSpec, where: str) -> Callable[[str], Any]:
    if spec.parse is not None:
        return _checked(spec.parse)
    if item in (str, int, float):
        return item  # argparse's own message: "invalid int value: 'x'"
    if item is bool:
        return parse_bool
    if isinstance(item, type) and issubclass(item, enum.Enum):
        return _enum_parser(item)
    raise TypeError(f"{where}: no reader for {item}; give flag(..., parse=...)")


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ``ValueError`` message shown as it is (argparse would hide it)."""

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


def _enum_parser(cls: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    def read(text: str) -> enum.Enum:
        try:
            return cls(text)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in cls)
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {allowed})"
            ) from None

    return read


def _comma_separated(parse: Callable[[str], Any], container: type) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                items.append(parse(part))
            except ValueError:  # int("a"): argparse would name only the whole value
                raise argparse.ArgumentTypeError(f"invalid item {part!r} in {text!r}") from None
        return container(items)

    return read


class _Append(argparse.Action):
    """A repeatable flag collecting its values into a tuple (or list), starting empty."""

    def __init__(self, *args: Any, collection: type, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.collection = collection  # tuple or list ("container" is argparse's own)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = getattr(namespace, self.dest, None) or ()
        new = values if isinstance(values, list) else [values]  # a list: nargs="+"
        setattr(namespace, self.dest, self.collection([*items, *new]))


def _metavar(item: Any) -> str:
    if isinstance(item, type) and issubclass(item, enum.Enum):
        return "{" + ",".join(str(m.value) for m in item) + "}"
    return getattr(item, "__name__", "VALUE").upper()


# -- help ------------------------------------------------------------------------------------


def _has_default(field: dataclasses.Field) -> bool:
    return (field.default is not dataclasses.MISSING
            or field.default_factory is not dataclasses.MISSING)


def _help(spec: FlagSpec, field: dataclasses.Field) -> str:
    """The help text, plus the default unless it is None or empty (the text says what that
    means). Escaped for argparse, which %-formats help."""
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = field.default
    text = spec.help
    empty = isinstance(default, (tuple, list)) and not default
    if default is not dataclasses.MISSING and default is not None and not empty:
        text += f" (default: {_shown(default)})"
    return text.replace("%", "%%")


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(_shown(v) for v in value)
    return str(value)


def _name_flag(message: str, flags: dict[str, str]) -> str:
    """"port must be ..." -> "--port must be ...": a message that starts with a field's name
    names its flag instead."""
    head, sep, rest = message.partition(" ")
    return flags[head] + sep + rest if head in flags else message


def json_object(value: object, where: str) -> Mapping[str, Any]:
    """A JSON-object flag's value (vLLM's ``--speculative-config``, ``--kv-transfer-config``):
    its text parsed, or the mapping given in Python; anything else is a ValueError naming
    ``where``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(  # noqa: TRY004 - bad configuration is a ValueError here
            f"{where} must be a JSON object, got {type(value).__name__}")
    return value
