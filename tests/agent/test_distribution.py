"""The agent as its own distribution: only the agent's code and dependencies."""

import zipfile

from provisioning.agentwheel import agent_wheel, install_wheels, pip_wheel, source_digest, wheels_ensure


def test_the_agent_wheel_holds_the_agent_alone_and_is_built_once(tmp_path):
    directory = wheels_ensure(tmp_path)
    assert directory.name == source_digest()
    with zipfile.ZipFile(agent_wheel(directory)) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(next(n for n in names if n.endswith("METADATA"))).decode()
        entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert {n.split("/")[0] for n in names} == {"agent", "llmgw_agent-0.1.0.dist-info"}
    requires = [line.split(":", 1)[1].strip().lower() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    assert not any(r.startswith(("django", "celery", "gunicorn", "psycopg")) for r in requires), requires
    assert any(r.startswith("httpx") for r in requires) and any(r.startswith("cryptography") for r in requires)
    assert "llmgw-agent = agent.cli:agent_command" in entry_points
    # Every dependency is there as a wheel: a node without internet installs with --no-index.
    wheels = {p.name.split("-")[0].lower() for p in directory.glob("*.whl")}
    assert {"httpx", "pyyaml", "cryptography", "prometheus_client", "llmgw_agent", "pip"} <= wheels
    # pip installs the others on the node and is not installed itself.
    assert pip_wheel(directory).name.startswith("pip-")
    assert pip_wheel(directory) not in install_wheels(directory) and agent_wheel(directory) in install_wheels(directory)
    built = agent_wheel(directory).stat().st_mtime
    assert wheels_ensure(tmp_path) == directory and agent_wheel(directory).stat().st_mtime == built


def test_llmgw_agent_csr_makes_a_key_that_stays_and_a_request_for_the_node(tmp_path, capsys):
    from cryptography import x509

    from agent.cli import agent_command

    key = tmp_path / "etc" / "node01-key.pem"
    assert agent_command(["csr", "--node", "node01", "--key", str(key)]) == 0
    first = x509.load_pem_x509_csr(capsys.readouterr().out.encode())
    assert key.stat().st_mode & 0o777 == 0o600
    assert agent_command(["csr", "--node", "node01", "--key", str(key)]) == 0
    second = x509.load_pem_x509_csr(capsys.readouterr().out.encode())
    assert first.public_key().public_numbers() == second.public_key().public_numbers()
    assert first.subject.rfc4514_string() == "CN=node01"
    assert agent_command(["csr", "--node", "Bad_Id", "--key", str(key)]) == 1
