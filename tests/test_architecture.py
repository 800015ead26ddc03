"""Imports point the way docs/architecture.md says they do.

Every import of every product package is read from the source (``ast``),
function-local ones included (a local import that dodges a cycle is still an
import), and checked against ``MAY_IMPORT``: the same table as the page's
"may import" column. A new edge in the graph is a decision: make it here and
on the page, or point the import the other way (a hook, as ``nodes/hooks.py``
does).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Which of the project's packages each product package may import (beyond
# the standard library and third-party packages). Layers point one way:
#   agent.protocol, core <- accounts <- pki <- nodes <- replicas <- gateway
# with provisioning beside replicas (on nodes and pki), and at the top the
# packages no app imports: ui, web, agentapi, cli, llmgw_site.
# "agent.protocol" names the one module of the agent an app may import.
LOW = ("core", "accounts")
MAY_IMPORT: dict[str, frozenset[str]] = {
    "agent": frozenset(),
    "core": frozenset(),
    "accounts": frozenset({"core"}),
    "pki": frozenset({*LOW, "agent.protocol"}),
    "nodes": frozenset({*LOW, "pki", "agent.protocol"}),
    "replicas": frozenset({*LOW, "pki", "nodes", "agent.protocol"}),
    "gateway": frozenset({*LOW, "pki", "nodes", "replicas", "agent.protocol"}),
    # agentwheel packages the agent itself: the only app that may import all of it.
    "provisioning": frozenset({*LOW, "pki", "nodes", "agent"}),
    "web": frozenset(LOW),
    "agentapi": frozenset({*LOW, "pki", "nodes", "agent.protocol"}),
    "ui": frozenset({*LOW, "pki", "nodes", "replicas", "gateway", "provisioning", "agent.protocol"}),
    "cli": frozenset({*LOW, "pki", "nodes", "replicas", "gateway", "provisioning", "agentapi", "agent"}),
}
# Settings, URLs and the Celery app name every part.
MAY_IMPORT["llmgw_site"] = frozenset({*MAY_IMPORT, "agent.protocol"} - {"llmgw_site"})
PACKAGES = frozenset(MAY_IMPORT) | {"tests", "bench", "tools"}

# replicas reads and locks nodes' rows in its own queries (its foreign keys
# point at Node, Gpu, Fabric; the lock order takes nodes first) and asks nodes
# to act through its services and hooks: these modules, and no others (not
# nodes' heartbeat, inventory, liveness or sweep).
NODES_SURFACE = frozenset({"nodes.models", "nodes.choices", "nodes.services", "nodes.selectors", "nodes.hooks"})
# Onboarding checks a node's address as a heartbeat does (nodes.validation).
NARROWED = {("replicas", "nodes"): NODES_SURFACE, ("gateway", "nodes"): NODES_SURFACE,
            ("provisioning", "nodes"): NODES_SURFACE | {"nodes.validation"}}

# The agent runs on the nodes, without Django.
AGENT_NEVER = ("django", "rest_framework", "celery", "kombu", "drf_spectacular")


@dataclass(frozen=True)
class Import:
    where: str  # path:line
    module: str  # absolute dotted name
    local: bool  # inside a function


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports_of(source: str, *, path: Path) -> list[Import]:
    """Every import in ``source`` (of the module at ``path``), resolved to
    absolute names, with whether it sits inside a function."""
    tree = ast.parse(source, str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            where = f"{path.relative_to(REPO)}:{getattr(child, 'lineno', 0)}"
            if isinstance(child, ast.Import):
                found.extend(Import(where, alias.name, local) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)] if child.level > 1 else package
                    module = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                found.append(Import(where, module, local))
                # "from core import outages" names a module: count it as core.outages.
                for alias in child.names:
                    if alias.name != "*":
                        found.append(Import(where, f"{module}.{alias.name}", local))
            visit(child, inner)

    visit(tree, False)
    return found


def _files(package: str):
    for path in sorted((REPO / package).rglob("*.py")):
        if "migrations" in path.parts or "__pycache__" in path.parts:
            continue
        yield path


def _allowed(package: str, module: str) -> bool:
    top = module.split(".")[0]
    if top == package or top not in PACKAGES:
        return True
    for allowed in MAY_IMPORT[package]:
        if module == allowed or module.startswith(allowed + "."):
            narrowed = NARROWED.get((package, allowed))
            return narrowed is None or module == allowed or any(
                module == m or module.startswith(m + ".") for m in narrowed)
    return False


def _violations(package: str) -> list[str]:
    wrong = []
    for path in _files(package):
        for imp in imports_of(path.read_text(), path=path):
            if not _allowed(package, imp.module):
                wrong.append(f"{imp.where}: {package} imports {imp.module}" + (" (in a function)" if imp.local else ""))
            if package == "agent" and imp.module.split(".")[0] in AGENT_NEVER:
                wrong.append(f"{imp.where}: the agent imports {imp.module}")
    return sorted(set(wrong))


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_the_way_the_architecture_page_says(package):
    wrong = _violations(package)
    assert not wrong, (
        f"{package} may import only {sorted(MAY_IMPORT[package]) or 'no other package'} "
        "(tests/test_architecture.py, docs/architecture.md):\n" + "\n".join(wrong)
    )


def _page_table() -> dict[str, set[str]]:
    """The "may import" column of docs/architecture.md: the packages named
    in code before any "never" (which lists what a row may not import)."""
    names = set(MAY_IMPORT) | {"agent.protocol"}
    rows = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`\w+/`", cells[0]):
            continue
        package, may = cells[0].strip("`/"), cells[2].split("never")[0]
        rows[package] = set(names) - {package} if may.strip() == "everything" else {
            name for name in re.findall(r"`([\w.]+)`", may) if name in names and name != package}
    return rows


def test_the_architecture_page_has_the_same_table():
    page = _page_table()
    assert set(page) == set(MAY_IMPORT), "a package has a row in one table and not the other"
    differ = {p: (sorted(page[p]), sorted(MAY_IMPORT[p])) for p in page if page[p] != set(MAY_IMPORT[p])}
    assert not differ, f"docs/architecture.md says, MAY_IMPORT says: {differ}"


def test_every_product_package_is_in_the_table():
    """A new top-level package gets a row (here and on the page) before it can hide."""
    tests_and_tools = {"tests", "bench", "tools", "scripts", "docs", "deploy", "mk", "var"}
    on_disk = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name not in tests_and_tools}
    assert on_disk <= set(MAY_IMPORT), f"packages with no row in MAY_IMPORT: {sorted(on_disk - set(MAY_IMPORT))}"


def test_function_local_imports_are_counted():
    """The scan sees an import inside a function (and a relative one) exactly
    as one at the top: a lazy import does not hide an edge."""
    source = (
        "import core\n"
        "def ready():\n"
        "    from replicas import hooks\n"
        "    if True:\n"
        "        from .. import services\n"
    )
    path = REPO / "nodes" / "api" / "example.py"
    found = {(i.module, i.local) for i in imports_of(source, path=path)}
    assert ("core", False) in found
    assert ("replicas.hooks", True) in found
    assert ("nodes.services", True) in found
    assert not _allowed("nodes", "replicas.hooks")
    # And in the tree: NodesConfig.ready's import of pki is seen, and as local.
    apps = imports_of((REPO / "nodes" / "apps.py").read_text(), path=REPO / "nodes" / "apps.py")
    assert any(i.module.startswith("pki") and i.local for i in apps)


def test_a_wrong_import_fails_the_check():
    """The check can fail: an import of gateway from nodes, and one of nodes'
    heartbeat from replicas, are both reported."""
    assert not _allowed("nodes", "gateway.selectors")
    assert not _allowed("core", "nodes.models")
    assert not _allowed("pki", "nodes")
    assert not _allowed("accounts", "nodes.exceptions")
    assert not _allowed("replicas", "nodes.heartbeat")
    assert not _allowed("replicas", "gateway")
    assert not _allowed("agent", "core")
    assert _allowed("replicas", "nodes.models")
    assert _allowed("replicas", "core.events")


def test_the_table_has_no_cycle():
    """No two packages may import each other, directly or around a circle
    (accounts and nodes did: accounts.services imported nodes.exceptions)."""
    tops = {p: {m.split(".")[0] for m in allowed} for p, allowed in MAY_IMPORT.items()}
    state: dict[str, str] = {}

    def visit(package: str, path: list[str]) -> None:
        state[package] = "open"
        for nxt in sorted(tops.get(package, ())):
            assert state.get(nxt) != "open", f"a cycle in MAY_IMPORT: {' -> '.join([*path, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[package] = "done"

    for package in sorted(tops):
        if package not in state:
            visit(package, [package])
