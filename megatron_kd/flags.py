"""Command-line flags made from configuration dataclasses: one default per flag.

A configuration section is a ``kw_only`` dataclass whose fields are declared with :func:`flag`
(the flag's name, help, choices, ...); :func:`add_flags` adds one argparse argument per field
with the field's own default, and :func:`from_flags` builds the dataclass back from a parsed
namespace. A field's default is written once, in the dataclass: the parser, the configuration
and every command that shares the section read it from there. A dataclass that cannot carry
flag metadata (one of another package, e.g. the loss's configuration) is given its flags as a
``specs`` mapping: its defaults still come from its own fields.

Pure Python: argparse and dataclasses only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["WIRE_DTYPES", "Flag", "KDSharedFlags", "add_flags", "default_of", "flag",
           "flag_spec", "from_flags", "shared_flag"]

_KEY = "megatron_kd.flag"


@dataclass(frozen=True, kw_only=True)
class Flag:
    """How one dataclass field appears on the command line."""

    help: str | None = None
    """The help text (argparse's ``%(default)s`` works)."""

    name: str | None = None
    """The flag (default: ``--`` and the field's name with ``-`` for ``_``)."""

    type: Callable[[str], Any] | None = None
    """Converts the string (default: the type of a non-None default, else ``str``)."""

    choices: tuple | None = None
    metavar: str | None = None
    nargs: str | None = None
    required: bool = False
    """No default: the flag must be given (the field then has no default either)."""

    group: str | None = None
    """The help section the flag is listed under (default: the one :func:`add_flags` makes)."""

    action: Any = None
    """An argparse action (``argparse.BooleanOptionalAction``: ``--x`` / ``--no-x``) instead of
    the one the default implies."""

    def option(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")

    def dest(self, field_name: str) -> str:
        """The namespace attribute argparse gives the flag (``--kd-loss``: ``kd_loss``)."""
        return self.option(field_name)[2:].replace("-", "_")


def flag(default: Any = dataclasses.MISSING, help: str | None = None, *,
         default_factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A dataclass field that is also a flag (:class:`Flag`'s fields as keywords). Without a
    default the flag is required."""
    meta = {_KEY: Flag(help=help, required=default is dataclasses.MISSING
                       and default_factory is None, **spec)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (MISSING when it has none)."""
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def flag_spec(cls: type, name: str) -> Flag:
    """The :class:`Flag` of field ``name`` of dataclass ``cls``."""
    return cls.__dataclass_fields__[name].metadata[_KEY]


def shared_flag(cls: type, name: str) -> Any:
    """A field declaring the same flag as field ``name`` of ``cls`` (its name, help and
    default): one flag that several commands' sections take, written once."""
    f = cls.__dataclass_fields__[name]
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _flags(cls: type, specs: Mapping[str, Flag] | None) -> list[tuple[str, Flag]]:
    out = []
    for f in dataclasses.fields(cls):
        spec = (specs or {}).get(f.name) or f.metadata.get(_KEY)
        if spec is not None:
            out.append((f.name, spec))
    return out


def add_flags(parser, cls: type, *, title: str | None = None,
              specs: Mapping[str, Flag] | None = None, only: Iterable[str] | None = None,
              exclude: Iterable[str] = (), required: Iterable[str] = (),
              help: Mapping[str, str] | None = None, groups: dict | None = None,
              use_groups: bool = True, lists: Mapping[str, Any] | None = None) -> None:
    """Add the flags of dataclass ``cls`` to ``parser`` (a parser or an argument group).

    Args:
        title: the help section the flags are listed under (None: ``parser`` itself).
        specs: flags of a dataclass whose fields carry none (field name -> :class:`Flag`).
        only / exclude: the fields to add (default: every field that is a flag).
        required: fields whose flag this command requires although the field has a default.
        help: another help text for some fields (a command that uses a flag differently).
        groups: the argument groups made so far, by title (shared between calls, so a
            ``Flag.group`` names one section across dataclasses).
        use_groups: False lists every flag under ``title`` (a command whose help has no
            sections), whatever its ``Flag.group``.
        lists: fields whose flag takes one value or more (``nargs="+"``: each converted by
            the flag's type and checked against its choices), stored by the given argparse
            action class.
    """
    groups = {} if groups is None else groups
    only = None if only is None else set(only)
    exclude, required = set(exclude), set(required)

    def target(group_title):
        if group_title is None:
            return parser
        if group_title not in groups:
            groups[group_title] = parser.add_argument_group(group_title)
        return groups[group_title]

    for name, spec in _flags(cls, specs):
        if (only is not None and name not in only) or name in exclude:
            continue
        default = default_of(cls, name)
        kwargs: dict[str, Any] = {"dest": spec.dest(name),
                                  "help": (help or {}).get(name, spec.help)}
        if spec.required or name in required or default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if spec.action is not None:
            kwargs["action"] = spec.action
        elif default is False and spec.type is None:
            kwargs["action"] = "store_true"
        else:
            plain = default is not None and default is not dataclasses.MISSING
            kwargs["type"] = spec.type or (type(default) if plain else str)
            for key in ("choices", "metavar", "nargs"):
                if getattr(spec, key) is not None:
                    kwargs[key] = getattr(spec, key)
            if lists and name in lists:
                kwargs["nargs"], kwargs["action"] = "+", lists[name]
        group = spec.group if use_groups and spec.group else title
        target(group).add_argument(spec.option(name), **kwargs)


def from_flags(cls: type, args: argparse.Namespace, *, specs: Mapping[str, Flag] | None = None,
               **overrides: Any):
    """``cls`` built from the parsed flags its fields declare (fields without a flag, or whose
    flag this command did not add, keep their defaults; ``overrides`` win)."""
    given = vars(args)
    values = {name: given[spec.dest(name)] for name, spec in _flags(cls, specs)
              if spec.dest(name) in given}
    values.update(overrides)
    return cls(**values)


#: Element types of the hidden states on a disaggregated teacher's wire (``--kd-wire-dtype``).
WIRE_DTYPES = ("fp32", "bf16", "fp8")


@dataclass(frozen=True, kw_only=True)
class KDSharedFlags:
    """The ``--kd-*`` flags more than one command declares (``megatron-kd train`` and the
    Megatron-LM hooks, ``cache build``, ``plan``), each with its one default: the commands'
    sections take these fields (:func:`shared_flag`), the planner its defaults
    (:func:`default_of`)."""

    topk: int = flag(100, "entries per token (K) of the offline top-K cache", name="--kd-topk")
    """Offline: the teacher's K most probable tokens stored per position."""

    prefetch_depth: int = flag(
        2, name="--kd-prefetch-depth", group="knowledge distillation: disaggregated teacher",
        help="disaggregated: requests in flight (token ids sent this many microbatches ahead, "
             "as many receive slots). Offline: microbatches of top-K values decoded ahead of "
             "training")
    """Disaggregated: requests in flight (and receive slots). Offline: microbatches decoded
    ahead of the one training."""

    wire_dtype: str | None = flag(
        None, name="--kd-wire-dtype", choices=WIRE_DTYPES,
        group="knowledge distillation: disaggregated teacher",
        help="disaggregated: element type of the hidden states on the wire: fp32, bf16, or fp8 "
             "(e4m3, one fp32 scale per token); default: --kd-teacher-dtype")
    """Disaggregated: the hidden states' element type on the wire (None: the teacher dtype's)."""
