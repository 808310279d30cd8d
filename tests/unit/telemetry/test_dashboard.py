"""The Grafana dashboard and the documented PromQL: every query parses and names only exported metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from fusion_graph.telemetry.metrics import NAMES
from tests.plugins.requires import service_missing

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "dashboards" / "fusion-graph.json"
DOC = ROOT / "docs" / "observability.md"
METRIC = re.compile(r"\bfusion_[a-z_]+\b")
#: Grafana's variables, as a range promtool can parse.
GRAFANA = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def doc_queries() -> list[str]:
    blocks = re.findall(r"```promql\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def plain(expr: str) -> str:
    for variable, value in GRAFANA.items():
        expr = expr.replace(variable, value)
    return expr


def test_every_query_names_only_exported_metrics() -> None:
    queries = dashboard_queries() + doc_queries()
    assert len(doc_queries()) >= 5
    named = {name for expr in queries for name in METRIC.findall(expr)}
    assert named and named <= set(NAMES), named - set(NAMES)
    # The dashboard shows every metric there is.
    assert {name for expr in dashboard_queries() for name in METRIC.findall(expr)} == set(NAMES)


def check_rules(queries: list[str], path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` over ``queries``, each a recording rule (how promtool parses PromQL)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        service_missing("promtool is not installed", fix="apt-get install prometheus")
    rules = "".join(
        f"      - record: fusion:query_{i}\n        expr: {json.dumps(expr)}\n"
        for i, expr in enumerate(queries)
    )
    path.write_text("groups:\n  - name: fusion\n    rules:\n" + rules, encoding="utf-8")
    command = [promtool, "check", "rules", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_every_query_parses(tmp_path: Path) -> None:
    queries = [plain(expr) for expr in dashboard_queries() + doc_queries()]
    checked = check_rules(queries, tmp_path / "rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(queries)} rules found" in checked.stdout


def test_a_broken_query_is_refused(tmp_path: Path) -> None:
    checked = check_rules(["sum(rate(fusion_tokens_total[5m])"], tmp_path / "rules.yml")
    assert checked.returncode != 0
