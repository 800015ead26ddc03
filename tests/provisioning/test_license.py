"""fakepve is AGPL-3.0: the tests may use it, no product module may import it."""

import re

from tests.conftest import REPO

PRODUCT = ["llmgw_site", "nodes", "pki", "replicas", "gateway", "provisioning", "agent", "cli", "agentapi"]
IMPORT = re.compile(r"^\s*(import|from)\s+fakepve\b", re.M)


def test_no_product_module_imports_fakepve():
    offenders = [
        str(path.relative_to(REPO))
        for package in PRODUCT
        for path in (REPO / package).rglob("*.py")
        if IMPORT.search(path.read_text(errors="replace")) or "__import__('fakepve'" in path.read_text(errors="replace")
    ]
    assert offenders == []


def test_fakepve_is_a_test_requirement_only():
    assert "fakepve" not in (REPO / "requirements.txt").read_text()
    assert "fakepve==" in (REPO / "requirements-dev.txt").read_text()
