"""The documentation's relative links resolve, and its test command is the
Makefile's.

README.md and docs/*.md link to each other and to files in the tree; a page
moved or a heading renamed breaks them silently. No services needed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The text without code blocks and inline code, where links are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        slug = _slug(match[1])
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    return [
        target for target in LINK.findall(_prose(page.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    ]


def test_slugs_follow_github():
    assert _slug("The gateway (`/v1`)") == "the-gateway-v1"
    assert _slug("Lifecycle, failure and rebuild") == "lifecycle-failure-and-rebuild"
    assert _slug("`llmgw ctl`") == "llmgw-ctl"


def test_the_pages_have_links_to_check():
    assert len(PAGES) > 5
    assert sum(len(relative_links(page)) for page in PAGES) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif not dest.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)} has broken links:\n  " + "\n  ".join(broken)


def _makefile_vars() -> dict[str, str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    values = {}
    for name, value in re.findall(r"^([A-Z_]+)\s*[:?]?=\s*(.*)$", text, re.MULTILINE):
        values.setdefault(name, value.strip())
    return values


def _expand(value: str, values: dict[str, str]) -> str:
    for _ in range(5):
        value = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), value)
    return value


def test_the_documented_test_command_is_the_makefiles():
    values = _makefile_vars()
    values["CURDIR"] = "$PWD"
    assignments = _expand(values["TEST_ENV"], values).split()
    assert [a.split("=", 1)[0] for a in assignments] == [
        "DATABASE_URL", "CELERY_BROKER_URL", "LLMGW_REDIS_URL", "LLMGW_DATA_DIR",
    ]
    command = _expand("$(TEST_CMD)", values).split()
    assert command[:len(assignments)] == assignments
    pytest_argv = command[len(assignments):]
    assert pytest_argv[:3] == [".venv/bin/python", "-m", "pytest"]
    assert pytest_argv[3:5] == ["-n", values["TEST_WORKERS"]], "the suite runs in parallel (docs/development.md)"
    block = "".join(f"{a} \\\n" for a in assignments) + "  " + " ".join(pytest_argv) + "\n"
    for page in (REPO / "README.md", REPO / "docs" / "development.md"):
        assert block in page.read_text(), f"{page.relative_to(REPO)} does not show the Makefile's test command:\n{block}"
