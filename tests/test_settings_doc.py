"""Every environment variable llmgw reads is documented once, in
docs/production.md's settings tables, and every variable documented there is
read by some code.

What is read: each ``env(...)``, ``env.<cast>(...)`` (django-environ),
``os.environ.get(...)``, ``os.environ[...]`` and ``os.getenv(...)`` call whose
first argument is a literal name, in the modules that read the environment:
``llmgw_site/settings.py`` (the control plane) and ``cli/env.py`` (the
``llmgw`` command). No services needed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READERS = [REPO / "llmgw_site" / "settings.py", REPO / "cli" / "env.py"]
DOC = REPO / "docs" / "production.md"
ROW = re.compile(r"^\|\s*(`[^|]*`)\s*\|", re.MULTILINE)
NAME = re.compile(r"`([A-Z][A-Z0-9_]*)`")


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def read_variables(path: Path) -> dict[str, int]:
    """Variable -> first line that reads it."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (
                (isinstance(func, ast.Name) and func.id == "env")  # env("X")
                or (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "env")
                or (isinstance(func, ast.Attribute) and func.attr == "get" and _is_os_environ(func.value))
                or (isinstance(func, ast.Attribute) and func.attr == "getenv"
                    and isinstance(func.value, ast.Name) and func.value.id == "os")
            ):
                name = _literal(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_os_environ(node.value):
            name = _literal(node.slice)
        if name:
            found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def documented_variables() -> dict[str, str]:
    """Variable -> the ``###`` section of docs/production.md's settings that lists it."""
    text = DOC.read_text()
    start = text.index("\n## Settings")
    end = text.find("\n## ", start + 1)
    section, heading, found = text[start:end if end != -1 else None], "Settings", {}
    for line in section.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        match = ROW.match(line)
        if match:
            for name in NAME.findall(match[1]):
                assert name not in found, f"docs/production.md lists {name} twice (## Settings, ### {found[name]} and ### {heading}): keep one row"
                found[name] = heading
    return found


def test_the_reader_finds_what_settings_read():
    """The parser sees each way settings.py reads a variable (a test that can fail)."""
    read = read_variables(REPO / "llmgw_site" / "settings.py")
    for name in ("LLMGW_PKI_DIR", "DATABASE_URL", "LLMGW_NODE_GRACE", "DJANGO_ALLOWED_HOSTS", "LLMGW_DEFRAG"):
        assert name in read, name
    assert {"LLMGW_URL", "LLMGW_DATA_DIR"} <= set(read_variables(REPO / "cli" / "env.py"))
    assert "PROMETHEUS_MULTIPROC_DIR" not in read  # written there, not read
    assert len(documented_variables()) > 50


def test_every_variable_read_is_documented_in_production_md():
    documented = documented_variables()
    missing = []
    for path in READERS:
        for name, line in sorted(read_variables(path).items()):
            if name not in documented:
                missing.append(
                    f"{name} (read at {path.relative_to(REPO)}:{line}) is not in docs/production.md: add a row "
                    f"'| `{name}` | <default> | <what it does> |' to the table of the '### ...' section of "
                    "'## Settings' where it belongs (one row per variable, nowhere else)"
                )
    assert not missing, "\n".join(missing)


def test_every_documented_variable_is_read():
    read = set()
    for path in READERS:
        read |= set(read_variables(path))
    unread = [
        f"{name} is listed in docs/production.md (## Settings, ### {section}) but neither "
        f"{' nor '.join(str(p.relative_to(REPO)) for p in READERS)} reads it: remove the row, or read it there"
        for name, section in sorted(documented_variables().items()) if name not in read
    ]
    assert not unread, "\n".join(unread)
