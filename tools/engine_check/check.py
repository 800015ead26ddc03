"""Pass every engine adapter's output through the engine's real argument parser.

Run inside an engine's own environment (``make engine-check`` builds them):

    .engine-venvs/vllm/bin/python tools/engine_check/check.py vllm
    .engine-venvs/sglang/bin/python tools/engine_check/check.py sglang

It imports llmgw's adapters from this checkout by path (they import nothing
but the standard library), builds the engine's own parser on the CPU without
a model, and:

1. writes the option table (``<engine>-<version>-options.json`` in
   ``replicas/engines/options/``, package data that the catalog reads at run
   time): every option string of the real parser, its dest, whether it takes
   a value, and its choices. Regular CI checks the adapters against it;
2. checks that every flag the adapters emit, refuse or let an entry override
   exists in that parser;
3. builds the launch spec of every rank of replicas of several shapes (1x1,
   1x8, 2x4, 2x8, 4x8, with and without extra arguments and parallel
   overrides), parses each argv with the real parser, compares what the
   parser read with what the adapter meant, and runs the engine's cheap
   model-free checks (vLLM: ``validate_parsed_serve_args`` and
   ``ParallelConfig``);
4. shows that the check has teeth: a mistyped flag fails the real parser,
   and an abbreviation the real parser accepts is refused by ``check_args``.

Exit status 0 when everything passed, 1 otherwise; the last line is a JSON
summary.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from replicas.engines import ADAPTERS, EngineArgsError, LaunchInput, check_args, launch_spec  # noqa: E402
from replicas.engines import flags  # noqa: E402

import shapes  # noqa: E402  (tools/engine_check/shapes.py)


from engine_parsers import ENGINES, CheckFailed, Engine  # noqa: E402  (tools/engine_check/engine_parsers.py)


# -- the option table ----------------------------------------------------------


def option_table(engine: Engine) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for action in engine.parser._actions:
        nargs = action.nargs
        if nargs == 0:
            value = "none"
        elif nargs in ("?", "*"):
            value = "optional"
        else:
            value = "required"
        choices = None
        if action.choices is not None and not isinstance(action.choices, dict):
            listed = list(action.choices)
            if all(isinstance(c, str) for c in listed):
                choices = sorted(set(listed))  # some are built from sets: keep the file stable
        for option in action.option_strings:
            options[option] = {
                "dest": action.dest,
                "value": value,
                "nargs": None if nargs is None else str(nargs),
                "choices": choices,
            }
    return {
        "engine": engine.name,
        "version": engine.version,
        "generated_by": "tools/engine_check/check.py (make engine-check)",
        "parser": {"vllm": "vllm.entrypoints.common.cli_args.make_arg_parser(FlexibleArgumentParser())",
                   "sglang": "sglang.srt.server_args.ServerArgs.add_cli_args (as prepare_server_args builds it)"}[engine.name],
        "options": dict(sorted(options.items())),
    }


def write_table(table: dict[str, Any], directory: Path) -> Path:
    path = flags.table_path(table["engine"], table["version"], directory)
    path.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


# -- the checks ----------------------------------------------------------------


@contextlib.contextmanager
def quiet():
    """argparse prints usage on error; keep the message, drop the rest."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            yield err
        except SystemExit as exc:
            last = [line for line in err.getvalue().splitlines() if line.strip()][-1:] or [f"exit {exc.code}"]
            raise CheckFailed(f"the parser refused it: {last[0]}") from None


def check_adapter_flags(engine: Engine, table: flags.OptionTable) -> list[str]:
    adapter = ADAPTERS[engine.name]
    problems = []
    for flag in sorted(set(adapter.managed) | set(adapter.overridable) | set(adapter.emitted) | set(adapter.fallback_aliases)):
        if flag not in table.options:
            problems.append(f"{flag}: named by the {engine.name} adapter, but not an option of {engine.name} {engine.version}")
    for prefix in adapter.managed_prefixes:
        if not any(o.startswith(prefix) for o in table.options):
            problems.append(f"{prefix}*: no {engine.name} option starts with it")
    for alias, flag in adapter.fallback_aliases.items():
        if alias in table.options and table.options[alias].dest != table.options.get(flag, table.options[alias]).dest:
            problems.append(f"{alias}: not an alias of {flag} in {engine.name} {engine.version}")
    return problems


def check_member(engine: Engine, table: flags.OptionTable, inp: LaunchInput) -> None:
    adapter = ADAPTERS[engine.name]
    spec = launch_spec(inp)
    own = spec.argv[engine.prefix :]
    # Every flag token is an exact, long option string of the real parser.
    for token in own:
        if flags.looks_like_flag(token):
            if not token.startswith("--"):
                raise CheckFailed(f"{token}: short flag emitted")
            name, _dotted = flags.option_name(adapter, token)
            if name not in table.options:
                raise CheckFailed(f"{token}: not an option of {engine.name} {engine.version} (abbreviated or unknown)")
    # Values present where required, none where none is taken.
    flags.parse_user_args(adapter, own[engine.positionals :], table)
    with quiet():
        parsed = engine.parse(spec.argv)
    with quiet():
        engine.validate(parsed, inp)
    layout = adapter.parallel_layout(adapter.read_args(list(inp.args)), nodes=inp.nodes, gpus_per_node=inp.gpus_per_node)
    got, want = engine.read(parsed), engine.expected(inp, layout)
    wrong = {k: (got[k], want[k]) for k in want if got.get(k) != want[k]}
    if wrong:
        raise CheckFailed("the parser read " + ", ".join(f"{k}={g!r} (meant {w!r})" for k, (g, w) in wrong.items()))
    if spec.serves_http != (inp.rank == 0):
        raise CheckFailed("serves_http must be true for rank 0 only")


def check_teeth(engine: Engine) -> list[str]:
    """The check must fail a mistyped flag; check_args must refuse an abbreviation."""
    problems = []
    inp = shapes.member(engine.name, nodes=2, gpus_per_node=4, rank=0)
    argv = launch_spec(inp).argv
    typo = {"vllm": "--tensor-paralel-size", "sglang": "--tp-sise"}[engine.name]
    try:
        with quiet():
            engine.parse(argv + [typo, "2"])
        problems.append(f"{typo}: the real parser accepted a mistyped flag")
    except CheckFailed:
        pass
    abbreviation = {"vllm": "--max-model", "sglang": "--context-len"}[engine.name]
    try:
        with quiet():
            engine.parse(argv + [abbreviation, "4096"])
    except CheckFailed:
        problems.append(f"{abbreviation}: expected the real parser to accept this abbreviation (allow_abbrev changed?)")
    try:
        check_args(engine.name, [abbreviation, "4096"])
        problems.append(f"{abbreviation}: check_args accepted an abbreviation")
    except EngineArgsError:
        pass
    return problems


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("engine", choices=sorted(ENGINES))
    cli.add_argument("--tables-dir", type=Path, default=flags.TABLES_DIR,
                     help="where to write the option table (default: replicas/engines/options, the package's own)")
    options = cli.parse_args(argv)

    started = time.monotonic()
    engine = ENGINES[options.engine]()
    adapter = ADAPTERS[engine.name]
    imported = time.monotonic() - started
    problems: list[str] = []
    if engine.version != adapter.version:
        problems.append(f"installed {engine.name} {engine.version}, the adapter is for {adapter.version}")
    entry = engine.entrypoint()

    table_data = option_table(engine)
    path = write_table(table_data, options.tables_dir)
    table = flags.OptionTable.from_dict(table_data)
    # The adapters read the table just written, not an older one.
    flags.TABLES_DIR = options.tables_dir

    problems += check_adapter_flags(engine, table)
    members = 0
    for inp in shapes.members(engine.name):
        members += 1
        label = f"{inp.nodes}x{inp.gpus_per_node} rank {inp.rank} args {inp.args}"
        try:
            check_member(engine, table, inp)
        except (CheckFailed, EngineArgsError) as exc:
            problems.append(f"{label}: {exc}")
    problems += check_teeth(engine)

    for problem in problems:
        print(f"FAIL {engine.name} {engine.version}: {problem}")
    summary = {
        "engine": engine.name,
        "version": engine.version,
        "entrypoint": entry,
        "options": len(table.options),
        "table": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
        "members_checked": members,
        "shapes": sorted({f"{i.nodes}x{i.gpus_per_node}" for i in shapes.members(engine.name)}),
        "problems": len(problems),
        "import_and_parser_seconds": round(imported, 1),
        "seconds": round(time.monotonic() - started, 1),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
    }
    status = "PASS" if not problems else "FAIL"
    print(f"{status} {engine.name} {engine.version}: {members} members parsed by the real parser, "
          f"{len(table.options)} option strings -> {summary['table']}")
    print(json.dumps(summary, sort_keys=True))
    return 0 if not problems else 1


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
