"""The operator API fuzzed against its own OpenAPI document.

schemathesis reads ``/api/schema/`` from the real web process and sends what
the schema allows and what it does not (every phase: the schema's examples,
its coverage cases, random fuzzing, and stateful sequences that feed one
answer into the next request), as an admin. Each answer must not be a server
error, must be a status the schema lists, and must match the schema given
for that status. Examples per operation are bounded and the generation is
deterministic, so a run is reproducible and takes a couple of minutes.
"""

from __future__ import annotations

import subprocess
import sys

from tests.factories import CatalogEntryFactory, EventFactory, node_with_gpus

# Operations that reach outside this machine: checking a hypervisor logs in to
# the Proxmox host it names (generated names would be looked up in DNS).
EXCLUDED = r"^/api/v1/hypervisors/\{name\}/check/$"
CHECKS = "not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance"


def test_the_operator_api_answers_as_its_schema_says(web_factory, admin_token, tmp_path):
    # Something to read, so that the answers' shapes are exercised with data.
    node = node_with_gpus("node01", gpus=2, fabric="ib-a")
    node_with_gpus("node02", gpus=2)
    EventFactory(node=node)
    EventFactory(node=None, subject="control-plane")
    CatalogEntryFactory(name="m", replicas=0)
    web = web_factory()
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{web.url}/api/schema/",
         "--header", f"Authorization: Bearer {admin_token}",
         "--checks", CHECKS,
         "--phases", "examples,coverage,fuzzing,stateful",
         "--max-examples", "8",
         "--generation-deterministic",
         "--exclude-path-regex", EXCLUDED,
         "--request-timeout", "30",
         "--workers", "1",
         "--report-dir", str(tmp_path / "report"),
         "--no-color"],
        # schemathesis keeps a cache in its working directory: not in the checkout.
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20000:] + "\n--- web log ---\n" + web.log()[-5000:]
