"""Stand-in modules for imports an argument parser never uses.

SGLang's ``sglang.srt.utils.common`` imports ``triton`` at the top for its
GPU kernels; the server-argument parser uses none of them, and on a machine
without a GPU ``triton`` is not installed. A stand-in answers every attribute
with a harmless object, and decorators (``@triton.jit``) return the function.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Anything:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Anything":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Anything(f"{self._name}()")

    def __getitem__(self, key) -> "_Anything":
        return self

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Anything:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Anything(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__llmgw_stub__ = True
        return module

    def exec_module(self, module) -> None:
        pass


def install_stub_modules(roots: set[str]) -> None:
    """Answer imports of these top-level packages (and their submodules) with stand-ins."""
    sys.meta_path.insert(0, _StubFinder(set(roots)))
