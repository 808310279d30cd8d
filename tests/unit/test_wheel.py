"""The ``fusion-graph`` wheel is the runtime: no test harness, no dev-only imports.

The harness lives in its own distribution (``fusion-graph-testing``, under
``testing/``). These tests read every module of the installed ``fusion_graph``
package and fail if a harness, or an import of what only the harness needs,
comes back into it.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import fusion_graph

#: Top-level modules only the test harness may import.
HARNESS_ONLY = frozenset({"fusion_graph_testing", "gguf", "numpy"})

_DYNAMIC_IMPORTERS = frozenset({"import_module", "__import__"})


def imported_roots(source: str) -> set[str]:
    """Top-level module names ``source`` imports, statically or by a constant dynamic import."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _DYNAMIC_IMPORTERS and isinstance(node.args[0].value, str):
                roots.add(node.args[0].value.partition(".")[0])
    return roots


def runtime_modules() -> dict[str, Path]:
    """Every module of the installed ``fusion_graph`` package, by name, with its source file."""
    modules = {"fusion_graph": Path(fusion_graph.__file__ or "")}
    for info in pkgutil.walk_packages(fusion_graph.__path__, prefix="fusion_graph."):
        spec = importlib.util.find_spec(info.name)
        assert spec is not None and spec.origin is not None, info.name
        modules[info.name] = Path(spec.origin)
    return modules


def test_harness_is_not_in_the_runtime_package() -> None:
    assert importlib.util.find_spec("fusion_graph.testing") is None


def test_walk_sees_the_whole_package() -> None:
    names = runtime_modules()
    assert {
        "fusion_graph",
        "fusion_graph.agent",
        "fusion_graph.providers.llama_server",
        "fusion_graph.routing.rule",
    } <= set(names)
    assert all(path.suffix == ".py" and path.is_file() for path in names.values())


def test_no_runtime_module_imports_harness_packages() -> None:
    offenders = {
        name: sorted(imported_roots(path.read_text(encoding="utf-8")) & HARNESS_ONLY)
        for name, path in runtime_modules().items()
    }
    assert {name: found for name, found in offenders.items() if found} == {}


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import numpy as np", {"numpy"}),
        ("import gguf.constants", {"gguf"}),
        ("from fusion_graph_testing.fake_openai import FakeOpenAI", {"fusion_graph_testing"}),
        ("def f():\n    from numpy import typing\n", {"numpy"}),
        ("import importlib\nimportlib.import_module('gguf')", {"importlib", "gguf"}),
        ("from . import routing\nfrom .llama import server_root", set()),
        ("import numpyro", {"numpyro"}),
    ],
)
def test_import_scan_catches_harness_imports(source: str, found: set[str]) -> None:
    assert imported_roots(source) == found
