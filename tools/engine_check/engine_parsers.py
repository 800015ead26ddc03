"""Each engine's real argument parser, loaded the way its own CLI loads it
(part of the engine check: ``check.py`` imports this from its directory)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from typing import Any, Callable

from replicas.engines import LaunchInput


class CheckFailed(Exception):
    pass


# -- the engines' parsers ----------------------------------------------------


class Engine:
    """One engine's real parser, loaded the way its own CLI loads it."""

    name: str
    prefix: int  # argv items before the parser's own (``vllm serve``)
    positionals: int = 0  # the parser's own positional arguments (vLLM's model)

    def __init__(self) -> None:
        self.version = importlib.metadata.version(self.name)
        self.parser = self.build_parser()

    def build_parser(self) -> argparse.ArgumentParser:
        raise NotImplementedError

    def parse(self, argv: list[str]) -> Any:
        raise NotImplementedError

    def validate(self, parsed: Any, inp: LaunchInput) -> None:
        pass

    def read(self, parsed: Any) -> dict[str, Any]:
        """What the parser understood, in the adapter's terms."""
        raise NotImplementedError

    def entrypoint(self) -> str:
        raise NotImplementedError


class Vllm(Engine):
    name = "vllm"
    prefix = 2
    positionals = 1

    def build_parser(self) -> argparse.ArgumentParser:
        # vLLM picks its platform at import; there is no GPU here.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    def parse(self, argv: list[str]) -> Any:
        if argv[: self.prefix] != ["vllm", "serve"]:
            raise CheckFailed(f"argv does not start with 'vllm serve': {argv[:3]}")
        return self.parser.parse_args(argv[self.prefix :])

    def validate(self, parsed: Any, inp: LaunchInput) -> None:
        from vllm.config import ParallelConfig
        from vllm.entrypoints.common.cli_args import validate_parsed_serve_args

        parsed.subparser = "serve"
        validate_parsed_serve_args(parsed)
        config = ParallelConfig(
            tensor_parallel_size=parsed.tensor_parallel_size,
            pipeline_parallel_size=parsed.pipeline_parallel_size,
            nnodes=parsed.nnodes,
            node_rank=parsed.node_rank,
            master_addr=parsed.master_addr,
            master_port=parsed.master_port,
            distributed_executor_backend=parsed.distributed_executor_backend,
        )
        if config.world_size != inp.nodes * inp.gpus_per_node:
            raise CheckFailed(f"ParallelConfig.world_size {config.world_size} != {inp.nodes} x {inp.gpus_per_node}")
        if config.world_size // config.nnodes != inp.gpus_per_node:
            raise CheckFailed(f"vLLM would start {config.world_size // config.nnodes} workers per node, not {inp.gpus_per_node}")

    def read(self, parsed: Any) -> dict[str, Any]:
        return {
            "weights": parsed.model_tag,
            "served": parsed.served_model_name,
            "tensor": parsed.tensor_parallel_size,
            "pipeline": parsed.pipeline_parallel_size,
            "nnodes": parsed.nnodes,
            "rank": parsed.node_rank,
            "leader": parsed.master_addr if parsed.nnodes > 1 else None,
            "rendezvous_port": parsed.master_port if parsed.nnodes > 1 else None,
            "backend": parsed.distributed_executor_backend,
            "headless": parsed.headless,
            "host": parsed.host,
            "port": parsed.port,
        }

    def expected(self, inp: LaunchInput, layout: dict[str, int]) -> dict[str, Any]:
        return {
            "weights": inp.weights,
            "served": [inp.model],
            "tensor": layout["tensor"],
            "pipeline": layout["pipeline"],
            "nnodes": inp.nodes,
            "rank": inp.rank,
            "leader": inp.leader_addr if inp.multi_node else None,
            "rendezvous_port": inp.rendezvous_port if inp.multi_node else None,
            "backend": "mp" if inp.multi_node else None,
            "headless": not inp.is_leader,
            "host": inp.mgmt_addr if inp.is_leader else None,
            "port": inp.http_port if inp.is_leader else 8000,
        }

    def entrypoint(self) -> str:
        scripts = importlib.metadata.entry_points(group="console_scripts", name="vllm")
        if not scripts:
            raise CheckFailed("the vllm distribution declares no 'vllm' command")
        return next(iter(scripts)).value


class Sglang(Engine):
    name = "sglang"
    prefix = 3

    def build_parser(self) -> argparse.ArgumentParser:
        _import_sglang_server_args()
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser(prog="sglang serve")
        ServerArgs.add_cli_args(parser)
        return parser

    def parse(self, argv: list[str]) -> Any:
        from sglang.srt.server_args import prepare_server_args

        if argv[: self.prefix] != ["python", "-m", "sglang.launch_server"]:
            raise CheckFailed(f"argv does not start with 'python -m sglang.launch_server': {argv[:4]}")
        return prepare_server_args(argv[self.prefix :])

    def validate(self, parsed: Any, inp: LaunchInput) -> None:
        # The model-free part of SGLang's check_server_args (the rest needs
        # resolution, which reads the model's config and the hardware).
        if (parsed.tp_size * (parsed.pp_size or 1)) % parsed.nnodes:
            raise CheckFailed("tp_size x pp_size is not divisible by nnodes")
        if ":" in parsed.served_model_name:
            raise CheckFailed("served model name has a ':'")

    def read(self, parsed: Any) -> dict[str, Any]:
        return {
            "weights": parsed.model_path,
            "served": parsed.served_model_name,
            "tensor": parsed.tp_size,
            "pipeline": parsed.pp_size or 1,
            "nnodes": parsed.nnodes,
            "rank": parsed.node_rank,
            "rendezvous": parsed.dist_init_addr,
            "host": parsed.host,
            "port": parsed.port,
        }

    def expected(self, inp: LaunchInput, layout: dict[str, int]) -> dict[str, Any]:
        return {
            "weights": inp.weights,
            "served": inp.model,
            "tensor": layout["tensor"],
            "pipeline": layout["pipeline"],
            "nnodes": inp.nodes,
            "rank": inp.rank,
            "rendezvous": inp.rendezvous if inp.multi_node else None,
            "host": inp.mgmt_addr,
            "port": inp.http_port if inp.is_leader else inp.worker_port,
        }

    def entrypoint(self) -> str:
        import importlib.util

        spec = importlib.util.find_spec("sglang.launch_server")
        if spec is None or not spec.origin:
            raise CheckFailed("sglang.launch_server is not importable as a module")
        return spec.origin


def _import_sglang_server_args() -> None:
    """Make ``sglang.srt.server_args`` importable on a CPU-only machine.

    ``sglang/__init__.py`` pulls in the frontend language and its heavy
    dependencies, so the package is registered without running it (its
    submodules load from the installed directory as usual). ``triton`` is
    imported by ``sglang.srt.utils.common`` for kernels the parser never
    uses; with no GPU it is absent, so a stand-in module answers instead.
    """
    import importlib.util
    import types

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise CheckFailed("sglang is not installed")
    if "sglang" not in sys.modules:
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        package.__file__ = spec.origin
        sys.modules["sglang"] = package
    if importlib.util.find_spec("triton") is None:
        from stubs import install_stub_modules

        install_stub_modules({"triton"})


ENGINES: dict[str, Callable[[], Engine]] = {"vllm": Vllm, "sglang": Sglang}
