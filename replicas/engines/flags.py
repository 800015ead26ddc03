"""Engine flags: the option tables read from the real parsers, and the reading
of a catalog entry's arguments against them.

Both engines build their parsers with argparse's default ``allow_abbrev``:
``--tp 8`` works today and means something else, or nothing, once a later
release adds ``--tp-foo``. So llmgw emits full flag names only, and refuses
abbreviations, short aliases (``-tp``) and unknown flags in what a catalog
entry passes, naming the flag.

The tables (``replicas/engines/options/<engine>-<version>-options.json``,
package data: a runtime-only install carries them) are written by
``make engine-check`` from the engines' own parsers and kept in the tree.
Each maps every option string to its ``dest``, whether it takes a value
(``none``, ``required``, ``optional``) and its ``choices``. An adapter that
names an engine version must find its table: a missing one raises
``OptionTableMissing`` rather than letting unknown flags through. Only an
adapter without a version (the sim engine, whose parser is ours) is checked
against what it knows itself: its managed flags and their prefixes.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import EngineArgsError

if TYPE_CHECKING:
    from .base import EngineAdapter

# Where the tables are read from: beside this module, in the installed
# package. tools/engine_check/check.py points it at the table it has just
# written; nothing else changes it. (This package imports only the standard
# library, so that the check runs in an engine's own environment, without
# Django: no setting here.)
TABLES_DIR = Path(__file__).resolve().parent / "options"
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def tables_dir() -> Path:
    return TABLES_DIR


def table_path(engine: str, version: str, directory: Path | None = None) -> Path:
    return (directory or tables_dir()) / f"{engine}-{version}-options.json"


@dataclass(frozen=True)
class Option:
    dest: str
    value: str  # "none" | "required" | "optional"
    nargs: str | None = None  # argparse's nargs, as text ("+", "*", "?", "2"); None for one value
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class OptionTable:
    engine: str
    version: str
    options: dict[str, Option]
    _by_dest: dict[str, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OptionTable":
        options = {
            name: Option(
                dest=o["dest"],
                value=o["value"],
                nargs=o.get("nargs"),
                choices=tuple(o["choices"]) if o.get("choices") is not None else None,
            )
            for name, o in data["options"].items()
        }
        by_dest: dict[str, set[str]] = {}
        for name, option in options.items():
            if name.startswith("--"):
                by_dest.setdefault(option.dest, set()).add(name)
        return cls(
            engine=data["engine"],
            version=data["version"],
            options=options,
            _by_dest={d: frozenset(n) for d, n in by_dest.items()},
        )

    def aliases(self, name: str) -> frozenset[str]:
        """Every long option that sets the same destination as ``name``."""
        option = self.options.get(name)
        if option is None:
            return frozenset({name})
        return self._by_dest.get(option.dest, frozenset()) | {name}

    def long_for(self, short: str) -> str | None:
        option = self.options.get(short)
        if option is None:
            return None
        names = sorted(n for n in self._by_dest.get(option.dest, ()) if not n.startswith("--no-"))
        return names[0] if names else None


@lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> OptionTable:
    with open(path, encoding="utf-8") as handle:
        return OptionTable.from_dict(json.load(handle))


class OptionTableMissing(RuntimeError):
    """An adapter's option table is not where the package keeps it: a broken
    install, not a caller's mistake (so not an ``EngineArgsError``)."""


def load_table(engine: str, version: str) -> OptionTable:
    path = table_path(engine, version)
    try:
        mtime = path.stat().st_mtime
    except OSError as exc:
        # Without the table, unknown and abbreviated flags would pass
        # unchecked: refuse to check at all instead.
        raise OptionTableMissing(
            f"the {engine} {version} option table {path} is missing ({exc.strerror}); "
            "it is package data of replicas.engines (written by make engine-check): reinstall llmgw"
        ) from None
    return _load(str(path), mtime)


@dataclass(frozen=True)
class UserFlag:
    raw: str  # as written in the catalog entry
    name: str  # the option string it is (underscores read as dashes where the engine does)
    names: frozenset[str]  # every long option that sets the same thing
    values: tuple[str, ...] = ()


def looks_like_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.match(token)


def option_name(adapter: "EngineAdapter", token: str) -> tuple[str, bool]:
    """The option string a long flag token sets, as the engine reads it, and
    whether it is one key of a JSON option (``--compilation-config.mode``)."""
    name, dotted = token.split("=", 1)[0], False
    if adapter.dotted_keys and "." in name:
        name, dotted = name.split(".", 1)[0], True
    if adapter.underscores_are_dashes:
        name = "--" + name[2:].replace("_", "-")
    return name, dotted


def parse_user_args(adapter: "EngineAdapter", args: list[str], table: OptionTable | None) -> list[UserFlag]:
    """Read a catalog entry's arguments as the engine's parser would.

    Raises ``EngineArgsError`` naming the first flag that is abbreviated,
    short, unknown, missing its value, given a value it does not take, or a
    stray positional argument.
    """
    if not isinstance(args, (list, tuple)):
        raise EngineArgsError(f"args must be a list of strings, not {type(args).__name__}")
    for i, token in enumerate(args):
        if not isinstance(token, str):
            raise EngineArgsError(f"args[{i}] must be a string, not {type(token).__name__} ({token!r})")
    engine = f"{adapter.name} {table.version}" if table and table.version else adapter.name
    parsed: list[UserFlag] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            raise EngineArgsError("args: a bare '--' is not allowed; every argument must belong to a flag")
        if not looks_like_flag(token):
            previous = f" after {args[i - 1]}" if i else ""
            raise EngineArgsError(
                f"{token!r}{previous}: not a flag, and no flag before it takes a value; the model path and name come from the catalog entry"
            )
        if not token.startswith("--"):
            long = table.long_for(token.split("=", 1)[0]) if table else None
            hint = f"write {long}" if long else "write the flag's full --name"
            raise EngineArgsError(f"{token}: short {adapter.name} flags are not accepted; {hint}")
        _key, has_inline, inline = token.partition("=")
        name, dotted = option_name(adapter, token)
        option = _resolve(adapter, name, token, table, engine)
        i += 1
        values: list[str] = [inline] if has_inline else []
        if option is None or dotted:
            # Unknown to us (no table), or one key of a JSON option: whatever
            # follows until the next flag is its value.
            while not has_inline and i < len(args) and not looks_like_flag(args[i]):
                values.append(args[i])
                i += 1
            if dotted and not values:
                raise EngineArgsError(f"{token}: needs a value")
        else:
            i = _take_values(token, option, args, i, values, has_inline)
        if table is not None:
            names = table.aliases(name)
        else:
            canonical = adapter.fallback_aliases.get(name, name)
            names = frozenset({name, canonical} | {a for a, c in adapter.fallback_aliases.items() if c == canonical})
        parsed.append(UserFlag(raw=token, name=name, names=names, values=tuple(values)))
    return parsed


def _resolve(adapter: "EngineAdapter", name: str, token: str, table: OptionTable | None, engine: str) -> Option | None:
    if table is not None:
        if name in table.options:
            return table.options[name]
        candidates = sorted(o for o in table.options if o.startswith(name) and o.startswith("--"))
        if candidates:
            raise EngineArgsError(f"{token}: abbreviated {engine} flag (could be {_some(candidates)}); write the full name")
        close = difflib.get_close_matches(name, [o for o in table.options if o.startswith("--")], n=3)
        hint = f"; did you mean {_some(close)}?" if close else ""
        raise EngineArgsError(f"{token}: unknown {engine} flag{hint}")
    known = adapter.known_flags()
    if name in known:
        return None
    candidates = sorted(o for o in known if o.startswith(name))
    if candidates:
        raise EngineArgsError(f"{token}: abbreviated {engine} flag (could be {_some(candidates)}); write the full name")
    return None


def _take_values(token: str, option: Option, args: list[str], i: int, values: list[str], has_inline: bool) -> int:
    def free(j: int) -> bool:
        return j < len(args) and not looks_like_flag(args[j])

    if option.value == "none":
        if has_inline:
            raise EngineArgsError(f"{token}: takes no value")
        return i
    if has_inline:
        return i
    if option.value == "optional":
        limit = 1 if option.nargs == "?" else len(args)
        while free(i) and limit:
            values.append(args[i])
            i += 1
            limit -= 1
        return i
    wanted = int(option.nargs) if option.nargs and option.nargs.isdigit() else 1
    while free(i) and (len(values) < wanted or option.nargs == "+"):
        values.append(args[i])
        i += 1
    if len(values) < wanted:
        raise EngineArgsError(f"{token}: needs a value")
    if option.choices is not None and option.nargs is None and values[0] not in option.choices:
        raise EngineArgsError(f"{token} {values[0]}: not one of {_some(list(option.choices), 8)}")
    return i


def _some(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
