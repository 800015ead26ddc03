"""Engine launch specs: the adapters' behaviour, and their output checked
against the option tables that ``make engine-check`` read from vLLM's and
SGLang's real argument parsers (so a flag that drifts is caught here without
installing the engines), and against the sim engine's own parser."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import pytest

from replicas.engines import (
    ADAPTERS,
    MANAGED_ENV,
    EngineArgsError,
    LaunchError,
    LaunchSpec,
    check_args,
    check_entry,
    check_env,
    launch_spec,
    member_ports,
)
from replicas.engines import flags

REPO = Path(__file__).resolve().parents[2]
TABLED = ["vllm", "sglang"]
COMMAND = {
    "vllm": ["vllm", "serve"],
    "sglang": ["python", "-m", "sglang.launch_server"],
    "sim": ["{python}", "-m", "agent.engines.sim"],
}


def _load_shapes():
    spec = importlib.util.spec_from_file_location("engine_check_shapes", REPO / "tools" / "engine_check" / "shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shapes = _load_shapes()
member = shapes.member


def table_of(engine: str) -> dict:
    adapter = ADAPTERS[engine]
    path = REPO / "replicas" / "engines" / "options" / f"{engine}-{adapter.version}-options.json"
    return json.loads(path.read_text())


def all_members():
    for engine in ("vllm", "sglang", "sim"):
        for inp in shapes.members(engine):
            yield pytest.param(inp, id=f"{engine}-{inp.nodes}x{inp.gpus_per_node}-r{inp.rank}-{len(inp.args)}args-{inp.fabric}")


def walk_flags(engine: str, argv: list[str], table: dict) -> list[str]:
    """Read argv against the table on its own (not with the code under test):
    every flag must be an exact long option, with its values where it takes them."""
    options = table["options"]
    adapter = ADAPTERS[engine]
    seen = []
    i = 0
    while i < len(argv):
        token = argv[i]
        assert token.startswith("--"), f"{token!r} at {i}: not a long flag, nor the value of the flag before it"
        name = token.split("=", 1)[0]
        if adapter.underscores_are_dashes:
            name = "--" + name[2:].replace("_", "-")
        assert name in options, f"{token}: not an option of {engine} {table['version']} (abbreviated or unknown)"
        option = options[name]
        i += 1
        seen.append(name)
        if "=" in token:
            assert option["value"] != "none", f"{token}: takes no value"
            continue
        if option["value"] == "required":
            count = int(option["nargs"]) if option["nargs"] and option["nargs"].isdigit() else 1
            for _ in range(count):
                assert i < len(argv) and not argv[i].startswith("--"), f"{token}: its value is missing"
                i += 1
            while option["nargs"] == "+" and i < len(argv) and not argv[i].startswith("--"):
                i += 1
        elif option["value"] == "optional":
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
    return seen


# -- the tables ----------------------------------------------------------------


@pytest.mark.parametrize("engine", TABLED)
def test_option_table_is_in_the_tree_for_the_adapters_version(engine):
    table = table_of(engine)
    assert table["engine"] == engine and table["version"] == ADAPTERS[engine].version
    assert "check.py" in table["generated_by"]
    assert len(table["options"]) > 300
    assert all(o["value"] in ("none", "required", "optional") for o in table["options"].values())


@pytest.mark.parametrize("engine", TABLED)
def test_every_flag_an_adapter_names_exists_in_its_engines_parser(engine):
    adapter = ADAPTERS[engine]
    options = table_of(engine)["options"]
    named = set(adapter.managed) | set(adapter.overridable) | set(adapter.emitted) | set(adapter.fallback_aliases)
    assert sorted(f for f in named if f not in options) == []
    for prefix in adapter.managed_prefixes:
        assert any(o.startswith(prefix) for o in options), prefix
    for alias, flag in adapter.fallback_aliases.items():
        assert options[alias]["dest"] == options[flag]["dest"], (alias, flag)


@pytest.mark.parametrize("inp", [p for p in all_members() if p.values[0].engine in TABLED])
def test_every_emitted_flag_exists_in_the_real_parsers_table(inp):
    spec = launch_spec(inp)
    command = COMMAND[inp.engine]
    assert spec.argv[: len(command)] == command
    own = spec.argv[len(command) :]
    if inp.engine == "vllm":
        assert own[0] == inp.weights  # the positional model
        own = own[1:]
    seen = walk_flags(inp.engine, own, table_of(inp.engine))
    assert len(seen) == len(set(seen)), f"a flag given twice: {seen}"


@pytest.mark.parametrize("inp", [p for p in all_members() if p.values[0].engine == "sim"])
def test_sim_argv_parses_with_the_sim_engines_own_parser(inp):
    from agent.engine_process import PYTHON_PLACEHOLDER
    from agent.engines.sim import parse_args

    spec = launch_spec(inp)
    assert spec.argv[0] == PYTHON_PLACEHOLDER
    parsed = parse_args(spec.argv[len(COMMAND["sim"]) :])
    assert (parsed.rank, parsed.nnodes, parsed.model) == (inp.rank, inp.nodes, inp.model)
    assert parsed.fabric == (inp.fabric or "")
    if inp.nodes > 1:
        assert parsed.rendezvous == f"{inp.leader_addr}:{inp.rendezvous_port}"
    if inp.rank == 0:
        assert (parsed.host, parsed.port) == (inp.mgmt_addr, inp.http_port)


@pytest.mark.parametrize("inp", list(all_members()))
def test_only_rank_zero_serves_and_every_rank_gets_its_allocation(inp):
    spec = launch_spec(inp)
    assert spec.serves_http is (inp.rank == 0)
    assert (spec.health_path is not None) is (inp.rank == 0)
    assert spec.gpus == inp.gpus
    assert spec.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, inp.gpus))
    if inp.rank == 0:
        assert spec.ports["http"] == inp.http_port
        assert ("rendezvous" in spec.ports) is (inp.nodes > 1)
    assert set(spec.ports) == set(member_ports(inp.engine, nodes=inp.nodes, rank=inp.rank))


# -- vLLM ------------------------------------------------------------------------


def test_vllm_single_node_leader_argv():
    spec = launch_spec(member("vllm", nodes=1, gpus_per_node=8, rank=0))
    assert spec.argv == [
        "vllm", "serve", "/models/llama-70b", "--served-model-name", "llama-70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
        "--host", "127.0.1.1", "--port", "20000",
    ]
    assert spec.ports == {"http": 20000}
    assert spec.health_url("127.0.1.1") == "http://127.0.1.1:20000/health"


def test_vllm_multi_node_leader_and_headless_worker():
    leader = launch_spec(member("vllm", nodes=2, gpus_per_node=4, rank=0))
    worker = launch_spec(member("vllm", nodes=2, gpus_per_node=4, rank=1))
    common = ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2", "--nnodes", "2"]
    assert leader.argv == [
        "vllm", "serve", "/models/llama-70b", "--served-model-name", "llama-70b", *common,
        "--node-rank", "0", "--master-addr", "127.0.1.1", "--master-port", "20001",
        "--distributed-executor-backend", "mp", "--host", "127.0.1.1", "--port", "20000",
    ]
    assert worker.argv == [
        "vllm", "serve", "/models/llama-70b", "--served-model-name", "llama-70b", *common,
        "--node-rank", "1", "--master-addr", "127.0.1.1", "--master-port", "20001",
        "--distributed-executor-backend", "mp", "--headless",
    ]
    assert leader.ports == {"http": 20000, "rendezvous": 20001} and worker.ports == {}
    assert not worker.serves_http and worker.health_url("127.0.1.2") is None
    assert worker.env["VLLM_HOST_IP"] == "127.0.1.2"


def test_vllm_parallel_sizes_can_be_overridden_and_must_fill_the_replica():
    spec = launch_spec(member("vllm", nodes=2, gpus_per_node=4, rank=0, args=["--tensor-parallel-size", "8"]))
    assert spec.argv.count("--tensor-parallel-size") == 1
    assert spec.argv[-2:] == ["--tensor-parallel-size", "8"]
    assert spec.argv[spec.argv.index("--pipeline-parallel-size") + 1] == "1"
    spec = launch_spec(member("vllm", nodes=1, gpus_per_node=8, rank=0, args=["--pipeline_parallel_size", "2"]))
    assert spec.argv[spec.argv.index("--tensor-parallel-size") + 1] == "4"
    assert "--pipeline-parallel-size" not in spec.argv
    with pytest.raises(EngineArgsError, match=r"--tensor-parallel-size 3: a replica has 2 node\(s\) x 4 GPUs = 8"):
        launch_spec(member("vllm", nodes=2, gpus_per_node=4, rank=0, args=["--tensor-parallel-size", "3"]))
    with pytest.raises(EngineArgsError, match="must equal 8"):
        check_args("vllm", ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], nodes=2, gpus_per_node=4)
    check_args("vllm", ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "4"], nodes=2, gpus_per_node=4)


# -- SGLang ----------------------------------------------------------------------


def test_sglang_leader_and_worker_argv():
    leader = launch_spec(member("sglang", nodes=2, gpus_per_node=4, rank=0))
    worker = launch_spec(member("sglang", nodes=2, gpus_per_node=4, rank=1))
    head = ["python", "-m", "sglang.launch_server", "--model-path", "/models/llama-70b",
            "--served-model-name", "llama-70b", "--tp-size", "8", "--nnodes", "2"]
    assert leader.argv == [*head, "--node-rank", "0", "--dist-init-addr", "127.0.1.1:20001",
                           "--host", "127.0.1.1", "--port", "20000"]
    # Ranks above 0 start SGLang's own small health server: on a port of their node.
    assert worker.argv == [*head, "--node-rank", "1", "--dist-init-addr", "127.0.1.1:20001",
                           "--host", "127.0.1.2", "--port", "20002"]
    assert leader.serves_http and not worker.serves_http
    assert leader.ports == {"http": 20000, "rendezvous": 20001} and worker.ports == {"health": 20002}
    assert member_ports("sglang", nodes=2, rank=1) == ("health",)


def test_sglang_single_node_has_no_multi_node_flags():
    spec = launch_spec(member("sglang", nodes=1, gpus_per_node=8, rank=0))
    assert not {"--nnodes", "--node-rank", "--dist-init-addr", "--pp-size"} & set(spec.argv)
    assert spec.argv[spec.argv.index("--tp-size") + 1] == "8"


def test_sglang_worker_without_its_own_port_is_refused():
    inp = dataclasses.replace(member("sglang", nodes=2, gpus_per_node=8, rank=1), worker_port=None)
    with pytest.raises(LaunchError, match="needs worker_port"):
        launch_spec(inp)


def test_sglang_pipeline_override_and_alias():
    spec = launch_spec(member("sglang", nodes=2, gpus_per_node=8, rank=0, args=["--pp-size", "2"]))
    assert spec.argv[spec.argv.index("--tp-size") + 1] == "8" and spec.argv.count("--pp-size") == 1
    spec = launch_spec(member("sglang", nodes=1, gpus_per_node=8, rank=0, args=["--tensor-parallel-size", "8"]))
    assert "--tp-size" not in spec.argv  # the entry's alias sets the same thing


def test_sglang_refuses_a_colon_in_the_served_name():
    with pytest.raises(EngineArgsError, match="':'"):
        launch_spec(member("sglang", nodes=1, gpus_per_node=1, rank=0, model="llama:70b"))
    with pytest.raises(EngineArgsError, match="':'"):
        check_entry(engine="sglang", name="llama:70b", args=[], env={}, nodes=1, gpus_per_node=1)
    check_entry(engine="vllm", name="llama:70b", args=[], env={}, nodes=1, gpus_per_node=1)


# -- sim -------------------------------------------------------------------------


def test_sim_members():
    leader = launch_spec(member("sim", nodes=2, gpus_per_node=4, rank=0))
    worker = launch_spec(member("sim", nodes=2, gpus_per_node=4, rank=1))
    assert leader.argv == ["{python}", "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "2",
                           "--rendezvous", "127.0.1.1:20001", "--host", "127.0.1.1", "--port", "20000",
                           "--model", "llama-70b", "--fabric", "ib-a"]
    assert worker.argv == ["{python}", "-m", "agent.engines.sim", "--rank", "1", "--nnodes", "2",
                           "--rendezvous", "127.0.1.1:20001", "--model", "llama-70b", "--fabric", "ib-a"]
    island = launch_spec(member("sim", nodes=1, gpus_per_node=1, rank=0))
    assert "--fabric" not in island.argv and "--rendezvous" not in island.argv
    assert island.ports == {"http": 20000}


def test_spec_fits_the_agent_protocol():
    from agent.protocol import DesiredMember

    inp = member("sim", nodes=2, gpus_per_node=4, rank=0)
    spec = launch_spec(inp)
    DesiredMember(member="m1", replica="r1", model=inp.model, rank=inp.rank, engine=inp.engine, argv=spec.argv,
                  env=spec.env, gpus=spec.gpus, ports=spec.ports, serves_http=spec.serves_http,
                  health_url=spec.health_url(inp.mgmt_addr))
    assert isinstance(spec, LaunchSpec)


# -- environment -----------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_nccl_environment_comes_from_the_nodes_inventory(engine):
    multi = launch_spec(member(engine, nodes=2, gpus_per_node=4, rank=1))
    assert multi.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"  # exact names: mlx5_1 must not also pick mlx5_10
    assert multi.env["NCCL_SOCKET_IFNAME"] == "=ens1f0"
    assert multi.env["GLOO_SOCKET_IFNAME"] == "ens1f0"
    assert multi.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    island = launch_spec(member(engine, nodes=1, gpus_per_node=2, rank=0))
    # No fabric, so no HCAs to name; the sockets and GPUs are set all the same.
    assert {k: v for k, v in island.env.items() if k.startswith(("NCCL_", "GLOO_", "CUDA_"))} == {
        "NCCL_SOCKET_IFNAME": "=ens1f0", "GLOO_SOCKET_IFNAME": "ens1f0", "CUDA_VISIBLE_DEVICES": "6,7"}
    on_fabric = launch_spec(member(engine, nodes=1, gpus_per_node=2, rank=0, fabric="ib-b"))
    assert on_fabric.env["NCCL_IB_HCA"] == "=mlx5_2,mlx5_3"


def test_user_env_is_merged_but_cannot_override_the_allocation(caplog):
    inp = dataclasses.replace(
        member("vllm", nodes=1, gpus_per_node=2, rank=0),
        env={"VLLM_LOGGING_LEVEL": "INFO", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "NCCL_IB_HCA": "mlx5"},
    )
    with caplog.at_level(logging.WARNING, logger="replicas.engines.base"):
        env = launch_spec(inp).env
    assert env["VLLM_LOGGING_LEVEL"] == "INFO"
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    # The entry's NCCL_IB_HCA is dropped, not passed on: an island member has no HCAs to name.
    assert "NCCL_IB_HCA" not in env
    assert "ignoring catalog env CUDA_VISIBLE_DEVICES,NCCL_IB_HCA" in caplog.text


@pytest.mark.parametrize("key", [*MANAGED_ENV, "VLLM_HOST_IP"])
def test_check_env_refuses_what_llmgw_sets(key):
    with pytest.raises(EngineArgsError, match=f"env: {key} is set by llmgw"):
        check_env("vllm", {key: "x"})


def test_check_env_accepts_the_rest_and_refuses_non_strings():
    accepted = {"HF_HUB_OFFLINE": "0", "NCCL_DEBUG": "INFO"}
    check_env("sglang", accepted)
    env = launch_spec(dataclasses.replace(member("sglang", nodes=1, gpus_per_node=2, rank=0), env=accepted)).env
    assert env["HF_HUB_OFFLINE"] == "0" and env["NCCL_DEBUG"] == "INFO"  # passed on as given
    with pytest.raises(EngineArgsError, match="must be a string"):
        check_env("sglang", {"NCCL_DEBUG": 1})


# -- check_args ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "args", "message"),
    [
        ("vllm", ["--max-model", "4096"], r"--max-model: abbreviated vllm 0.33.0 flag \(could be --max-model-len\)"),
        ("vllm", ["--tensor-parallel", "2"], "--tensor-parallel: abbreviated"),
        ("sglang", ["--tp", "8"], r"--tp: abbreviated sglang 0.5.23 flag \(could be --tp-size\)"),
        ("sglang", ["--pp", "2"], "--pp: abbreviated sglang 0.5.23 flag .*--pp-size"),
        ("sglang", ["--context-len=4096"], "--context-len=4096: abbreviated"),
        ("vllm", ["-tp", "2"], "-tp: short vllm flags are not accepted; write --tensor-parallel-size"),
        ("vllm", ["-O3"], "-O3: short vllm flags"),
        ("vllm", ["--tensor-paralel-size", "2"], "unknown vllm 0.33.0 flag; did you mean --tensor-parallel-size"),
        ("sglang", ["--no-such-flag"], "--no-such-flag: unknown sglang 0.5.23 flag"),
        ("vllm", ["--port", "9000"], "--port: vllm flag --port is set by llmgw"),
        ("vllm", ["--node_rank", "1"], "--node_rank: vllm flag --node-rank is set by llmgw"),
        ("vllm", ["--headless"], "--headless: vllm flag --headless is set by llmgw"),
        ("vllm", ["--data-parallel-size", "2"], "--data-parallel-size is set by llmgw .*scale with the catalog's replicas"),
        ("vllm", ["--distributed-executor-backend", "ray"], "--distributed-executor-backend is set by llmgw"),
        ("vllm", ["--config", "/etc/vllm.yaml"], "--config is set by llmgw"),
        ("vllm", ["--served-model-name", "other"], "--served-model-name is set by llmgw"),
        ("sglang", ["--model", "/models/x"], "--model: sglang flag --model(-path)? is set by llmgw"),
        ("sglang", ["--nccl-init-addr", "h:1"], "--nccl-init-addr: sglang flag --(dist|nccl)-init-addr is set by llmgw"),
        ("sglang", ["--nccl-port", "30001"], "--nccl-port is set by llmgw .*ports are allocated per node"),
        ("sglang", ["--base-gpu-id", "2"], "--base-gpu-id is set by llmgw"),
        ("sim", ["--rank", "1"], "--rank: sim flag --rank is set by llmgw"),
        ("vllm", ["--max-model-len"], "--max-model-len: needs a value"),
        ("vllm", ["--max-model-len", "--enforce-eager"], "--max-model-len: needs a value"),
        ("vllm", ["--enforce-eager=true"], "--enforce-eager=true: takes no value"),
        ("vllm", ["--enforce-eager", "/models/other"], "'/models/other' after --enforce-eager: not a flag"),
        ("sglang", ["/models/other"], "'/models/other': not a flag"),
        ("vllm", ["--"], "bare '--'"),
        ("vllm", ["--max-model-len", 8192], r"args\[1\] must be a string"),
        ("vllm", "--enforce-eager", "args must be a list"),
    ],
)
def test_check_args_refuses_naming_the_flag(engine, args, message):
    with pytest.raises(EngineArgsError, match=message):
        check_args(engine, args)


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("vllm", ["--max-model-len", "8192", "--enforce-eager", "--max_num_seqs", "128"]),
        ("vllm", ["--max-model-len=8192", "--gpu-memory-utilization", "0.85"]),
        ("vllm", ["--compilation-config", '{"cudagraph_mode": "FULL"}']),
        ("vllm", ["--compilation-config.cudagraph_mode", "FULL"]),
        ("vllm", ["--tensor-parallel-size", "8"]),
        ("sglang", ["--context-length", "8192", "--enable-metrics", "--mem-fraction-static", "0.8"]),
        ("sglang", ["--tp-size", "8", "--ep-size", "8"]),
        ("sim", ["--token-delay", "0.01"]),
        ("vllm", []),
    ],
)
def test_check_args_accepts_full_flags(engine, args):
    check_args(engine, args)
    argv = launch_spec(dataclasses.replace(member(engine, nodes=1, gpus_per_node=8, rank=0), args=args)).argv
    assert argv[len(argv) - len(args):] == args  # passed on as written, after llmgw's own flags


def test_unknown_engine_is_refused():
    with pytest.raises(EngineArgsError, match="engine 'tgi' is not one of sglang, sim, vllm"):
        check_args("tgi", [])


def test_a_missing_option_table_is_a_loud_error_not_an_unchecked_flag(monkeypatch, tmp_path):
    """An install without the tables must not quietly pass unknown flags on."""
    monkeypatch.setattr(flags, "TABLES_DIR", tmp_path)
    for engine in TABLED:
        with pytest.raises(flags.OptionTableMissing, match=rf"the {engine} .* option table {tmp_path}/{engine}-.*-options.json is missing"):
            check_args(engine, ["--some-future-flag", "1"])
    # The sim engine names no version: it is checked against its own flags, table or not.
    check_args("sim", ["--token-delay", "0.01"])


def test_the_option_tables_are_package_data():
    """What the catalog reads at run time is inside the package and declared
    as package data, so a runtime-only install carries it (make prod-check
    proves it on a real install)."""
    import tomllib

    for engine in TABLED:
        path = flags.table_path(engine, ADAPTERS[engine].version)
        assert path.is_file() and path.is_relative_to(REPO / "replicas"), path
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = pyproject["tool"]["setuptools"]["package-data"]["replicas.engines"]
    assert "options/*.json" in declared


# -- members the scheduler must never produce -------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fabric": None, "hcas": []}, "needs a fabric"),
        ({"rank": 2}, r"rank must be in 0..1"),
        ({"gpus": [0, 1]}, "needs 4 distinct GPUs"),
        ({"gpus": [0, 0, 1, 2]}, "needs 4 distinct GPUs"),
        ({"rendezvous_port": None}, "rendezvous_port"),
        ({"hcas": []}, "has no HCA in fabric ib-a"),
        ({"mgmt_interface": ""}, "no mgmt_interface"),
    ],
)
def test_impossible_members_are_refused(change, message):
    inp = dataclasses.replace(member("vllm", nodes=2, gpus_per_node=4, rank=1), **change)
    with pytest.raises(LaunchError, match=message):
        launch_spec(inp)


def test_a_sim_member_needs_no_hcas():
    spec = launch_spec(dataclasses.replace(member("sim", nodes=2, gpus_per_node=4, rank=1), hcas=[]))
    assert spec.argv[spec.argv.index("--rank") + 1] == "1" and "--rendezvous" in spec.argv
    assert spec.gpus == [4, 5, 6, 7] and "NCCL_IB_HCA" not in spec.env and not spec.serves_http


def test_member_ports():
    assert member_ports("vllm", nodes=1, rank=0) == ("http",)
    assert member_ports("vllm", nodes=4, rank=0) == ("http", "rendezvous")
    assert member_ports("vllm", nodes=4, rank=3) == ()
    assert member_ports("sim", nodes=2, rank=1) == ()
    assert member_ports("sglang", nodes=2, rank=1) == ("health",)


def test_the_sim_flag_table_is_the_sim_engines_parser():
    """replicas may not import the agent's engine: its table of the sim's flags
    is held here against the parser it describes, defaults included."""
    from agent.engines import sim as sim_engine
    from agent.engines.sim_model import SimParams
    from replicas.engines.sim import SIM_DEFAULTS, SIM_OPTIONS, SimAdapter

    parser_flags = {name: action for action in sim_engine.build_parser()._actions for name in action.option_strings}
    known = set(SIM_OPTIONS) | set(SimAdapter.managed) | {"--help", "-h"}
    assert set(parser_flags) == known
    for name, option in SIM_OPTIONS.items():
        action = parser_flags[name]
        assert action.dest == option.dest, name
        expected = {"count": int, "seconds": float, "switch": None}[option.kind]
        assert (action.type if option.kind != "switch" else None) is expected, name
    assert SIM_DEFAULTS == {"block_size": SimParams.block_size, "num_gpu_blocks_override": SimParams.num_gpu_blocks,
                            "max_model_len": SimParams.max_model_len}
