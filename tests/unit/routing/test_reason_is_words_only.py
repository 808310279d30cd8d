"""A record's fields are written from typed values, never read back from its reason text.

``reason`` is for people: the words may change. Whether a step was paced, kept
local by the budget or latched is a field of the decision, so no code parses
the reason to find out (``replay.summary`` once did, with a marker).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "fusion_graph"
#: String methods that read text rather than compose it.
READS = {"startswith", "endswith", "split", "rsplit", "partition", "rpartition", "find", "index", "count"}


def is_reason(node: ast.AST) -> bool:
    """``x.reason``, ``x["reason"]`` or ``x.get("reason")``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "reason"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "reason"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "reason"
    return False


def reason_reads(source: str) -> list[int]:
    """Lines where ``source`` tests or parses a reason's text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            if any(is_reason(side) for side in node.comparators):
                found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            parsed = node.func.attr in READS and is_reason(node.func.value)
            searched = (  # re.search(..., decision.reason) and the like
                isinstance(node.func.value, ast.Name)
                and node.func.value.id == "re"
                and any(is_reason(arg) for arg in node.args)
            )
            if parsed or searched:
                found.append(node.lineno)
    return found


def test_the_scan_finds_each_way_of_reading_a_reason() -> None:
    source = (
        "a = 'paced' in decision.reason\n"
        "b = record['reason'].startswith('x')\n"
        "c = re.search('paced', r.get('reason'))\n"
        "d = f'{decision.reason}; over budget'\n"  # composing words is fine
    )
    assert reason_reads(source) == [1, 2, 3]


def test_no_module_reads_a_field_back_from_a_reason() -> None:
    hits = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in reason_reads(path.read_text(encoding="utf-8"))
    ]
    assert hits == []
