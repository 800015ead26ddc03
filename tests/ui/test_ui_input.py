"""Every form of the web UI answers hostile input with a page, a message or a
redirect: never a 500. Each action is posted with every field (and ``next``,
where the answer goes back to) set to the same odd value. Addresses are only
ever loopback ones or refused by validation: no name is looked up."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

VALUES = ["", "\x00", "a" * 5000, "99999999999999999999999", "-1", "SHA256:" + "A" * 43,
          "ib-a:" + "mlx5_0," * 500, "../../etc/passwd", "😀", "<script>x</script>", "//evil.example/",
          "https://evil.example/", "javascript:alert(1)", "ui-cluster"]
FIELDS = ["node", "hypervisor", "vmid", "ip", "gateway", "cores", "memory", "disk", "ssh_port", "ssh_user",
          "fabrics", "mgmt_interface", "nvidia_smi", "ib_root", "host_key_fingerprint", "confirmed", "skip_gpus",
          "reinstall", "agent_server", "onboard", "replicas", "yaml", "prune", "name", "reason", "next"]
ACTIONS = [
    "/nodes/node01/cordon/", "/nodes/node01/uncordon/", "/nodes/node01/drain/", "/nodes/node01/drain/cancel/",
    "/nodes/node01/revoke/", "/nodes/node01/reonboard/", "/nodes/no-such-node/reonboard/",
    "/models/llama-70b/scale/", "/catalog/apply/", "/gateway/keys/", "/gateway/keys/no-such-key/revoke/",
    "/provisioning/vm/", "/provisioning/onboard/", "/provisioning/jobs/999/retry/", "/provisioning/jobs/999/cancel/",
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_every_action_answers_odd_input_without_a_500(admin_client_ui, small_cluster, value):
    admin_client_ui.raise_request_exception = False
    for path in ACTIONS:
        body = {field: value for field in FIELDS}
        for extra in ({}, {"step": "read-key", "addr": "127.0.0.1", "ssh_port": "1"},
                      {"step": "onboard", "confirmed": "on", "addr": "127.0.0.1"}):
            answer = admin_client_ui.post(path, {**body, **extra})
            assert answer.status_code < 500, (path, extra, answer.status_code)
            if answer.status_code in (301, 302):
                # Back to a page of this site, whatever ``next`` said.
                assert answer["Location"].startswith("/") and not answer["Location"].startswith("//"), answer["Location"]
