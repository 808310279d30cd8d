"""Module docstrings name only what exists: every dotted name in double backticks resolves.

A module's docstring says which modules and functions hold the rest of its
story (``providers.chain.ask``, ``memory.runs``); when code moves, the name in the
prose is the first thing to go stale. Each dotted name is looked up as written:
in the package (``fusion_graph.`` + the name, also relative to the module's own
package), or as another library's module path.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import fusion_graph

#: ``a.b`` or ``a.b.C``: a dotted name starting with a module-like part.
DOTTED = re.compile(r"``([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?``")
#: Dotted names that are not Python names (files, attributes of values, LangGraph config keys,
#: OpenTelemetry attribute names).
NOT_NAMES = re.compile(
    r"\.(py|json|toml|md|jsonl|sqlite|txt|log)$|^(record|extra|state|runtime|context|settings|config"
    r"|request|gen_ai|fusion)\."
)


def modules() -> list[str]:
    names = ["fusion_graph"]
    for info in pkgutil.walk_packages(fusion_graph.__path__, "fusion_graph."):
        if not info.name.endswith("__main__"):  # importing it runs the command line
            names.append(info.name)
    return sorted(names)


def docstring_of(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""


def lookup(path: str) -> Any:
    """The object at ``path`` (a module, then attributes), or raise ``LookupError``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                raise LookupError(path)
            found = getattr(found, attribute)
        return found
    raise LookupError(path)


def resolves(name: str, module: ModuleType) -> bool:
    package = module.__name__ if hasattr(module, "__path__") else module.__name__.rpartition(".")[0]
    first, _, rest = name.partition(".")
    if hasattr(module, first):  # a name the module imports or defines, then its attributes
        found: Any = getattr(module, first)
        try:
            for part in rest.split("."):
                found = getattr(found, part)
        except AttributeError:
            pass
        else:
            return True
    for base in ("fusion_graph.", f"{package}.", ""):
        try:
            lookup(base + name)
        except LookupError:
            continue
        return True
    return False


@pytest.mark.parametrize("name", modules())
def test_dotted_names_in_module_docstrings_resolve(name: str) -> None:
    module = importlib.import_module(name)
    stale = [
        found
        for found in DOTTED.findall(docstring_of(name))
        if not NOT_NAMES.search(found) and not resolves(found, module)
    ]
    assert stale == [], f"{name}'s docstring names what does not exist: {stale}"


#: An index line of a package docstring: ``- ``module``: what it holds``.
INDEX_LINE = re.compile(r"^- ``([a-z_]+)``:", re.M)


@pytest.mark.parametrize("name", [n for n in modules() if hasattr(importlib.import_module(n), "__path__")])
def test_a_package_index_lists_exactly_its_modules(name: str) -> None:
    listed = set(INDEX_LINE.findall(docstring_of(name)))
    if not listed:
        return  # a package described in prose
    package = importlib.import_module(name)
    present = {info.name for info in pkgutil.iter_modules(package.__path__)}
    assert listed == present, (
        f"{name}: listed but missing {listed - present}, present but not listed {present - listed}"
    )
