"""The docs: generated tables and `.env.example`, ignore files, links that resolve."""

from __future__ import annotations

import fnmatch
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from typing_extensions import is_typeddict

from fusion_graph.cli.docs import config_rows, env_example, env_value
from fusion_graph.context import FusionContext
from fusion_graph.routing import records
from fusion_graph.routing.records import RouteRecord
from fusion_graph.settings import ENV_PREFIX, FusionSettings

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
ROUTE_LOG = ROOT / "docs" / "route_log.md"
SETTING = re.compile(rf"^# ({ENV_PREFIX}[A-Z0-9_]+)=(.*)$")


def settings(text: str) -> dict[str, str]:
    """``FUSION_*`` name -> the value shown, from the commented-out setting lines."""
    found = (SETTING.match(line) for line in text.splitlines())
    return {match[1]: match[2] for match in found if match}


def test_the_committed_env_example_is_generated_from_the_code() -> None:
    committed = (ROOT / ".env.example").read_text(encoding="utf-8")
    assert committed == env_example(), ".env.example is stale: run `python -m fusion_graph.cli.docs`"


def test_the_env_example_lists_every_setting_once_and_the_key_unset() -> None:
    text = env_example()
    names = [match[1] for match in (SETTING.match(line) for line in text.splitlines()) if match]
    assert sorted(names) == sorted(row[4] for row in config_rows())
    assert len(names) == len(set(names))
    operator = {ENV_PREFIX + name.upper() for name in FusionSettings.model_fields}
    assert operator | set(FusionContext().env_names.values()) == set(names)
    assert "\n# OPENAI_API_KEY=\n" in text, "the key variable is listed, commented out"
    # Nothing is set: `langgraph dev` loads .env over the environment, and an empty key would blank it.
    assert [line for line in text.splitlines() if line and not line.startswith("#")] == []


def test_each_shown_operator_value_reads_back_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = settings(env_example())
    fields = {ENV_PREFIX + name.upper(): name for name in FusionSettings.model_fields}
    operator = {name: value for name, value in shown.items() if name in fields and value}
    assert {"FUSION_LOCAL_PRICE_PER_MTOK", "FUSION_PRICE_OVERRIDES", "FUSION_REQUEST_TIMEOUT"} <= set(
        operator
    )
    for name, value in operator.items():
        monkeypatch.setenv(name, value)
    assert FusionSettings() == FusionSettings.model_construct()


def test_each_shown_run_default_reads_back_as_the_default() -> None:
    shown = settings(env_example())
    names = set(FusionContext().env_names.values())
    run = {name: value for name, value in shown.items() if name in names and value}
    assert {"FUSION_MODE", "FUSION_CLOUD_SHARE"} <= set(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | run
    code = (
        "from fusion_graph.context import DEFAULTS, ENV_KEYS, ensure_context; c = ensure_context(None); "
        "print(all(getattr(c, n) == DEFAULTS[k] for n, k in ENV_KEYS.items()))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_env_values() -> None:
    assert env_value(True) == "true"
    assert env_value((0.0, 0.5)) == "[0.0, 0.5]"
    assert env_value({}) == "{}"
    assert env_value(None) == ""
    assert env_value("x" * 100) == "", "the system prompt is not repeated"


# --------------------------------------------------------------------------- ignore files

SECRETS = [".env", ".env.production", ".env.local"]
KEPT = [".env.example", "fusion_graph/agent.py", "pyproject.toml", "README.md", "langgraph.json"]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
@pytest.mark.parametrize(("path", "ignored"), [(p, True) for p in SECRETS] + [(p, False) for p in KEPT])
def test_git_ignores_env_files_but_not_the_example(path: str, ignored: bool) -> None:
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True, check=False
    )
    assert result.returncode in (0, 1), result.stderr
    assert (result.returncode == 0) is ignored


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's ``.dockerignore`` rules, closely enough for these paths: the last match wins."""
    ignored = False
    for raw in patterns:
        negate, pattern = raw.startswith("!"), raw.removeprefix("!")
        candidates = [pattern, pattern.removeprefix("**/")]
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        tails = ["/".join(parts[i:]) for i in range(len(parts))] if pattern.startswith("**/") else []
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes + tails for c in candidates):
            ignored = not negate
    return ignored


@pytest.mark.parametrize(
    ("path", "ignored"),
    [(p, True) for p in SECRETS]
    + [
        ("deploy/.env", True),
        (".git/HEAD", True),
        (".venv/bin/python", True),
        ("fusion_graph/__pycache__/graph.cpython-311.pyc", True),
        ("bench/results/kv.json", True),
        ("models/tiny.gguf", True),
        ("tiny.gguf", True),
        (".langgraph_api/store.pckl", True),
        (".mypy_cache/x", True),
    ]
    + [(p, False) for p in KEPT],
)
def test_docker_build_context_leaves_out_secrets_and_local_state(path: str, ignored: bool) -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert docker_ignored(path, patterns) is ignored


# --------------------------------------------------------------------------- the configuration table


def test_the_configuration_table_is_generated_from_the_context() -> None:
    from fusion_graph.cli.docs import render_readme_table

    text = CONFIGURATION.read_text(encoding="utf-8")
    assert render_readme_table(text) == text, (
        "docs/configuration.md table is stale: run "
        "`python -m fusion_graph.cli.docs docs/configuration.md .env.example`"
    )


def test_the_route_log_field_table_is_generated_from_the_record() -> None:
    from fusion_graph.cli.docs import render_record_table

    text = ROUTE_LOG.read_text(encoding="utf-8")
    assert render_record_table(text) == text, (
        "docs/route_log.md field table is stale: run "
        "`python -m fusion_graph.cli.docs docs/configuration.md .env.example`"
    )


def test_the_field_table_lists_every_key_the_record_classes_declare() -> None:
    from fusion_graph.cli.docs import record_fields

    def keys(cls: Any, prefix: str = "") -> set[str]:
        found = set()
        for name, kind in get_type_hints(cls).items():
            found.add(prefix + name)
            inner = get_args(kind)[0] if get_origin(kind) is list else kind
            if is_typeddict(inner):
                found |= keys(inner, f"{prefix}{name}{'[]' if inner is not kind else ''}.")
        return found

    listed = [name for name, _, _ in record_fields()]
    assert len(listed) == len(set(listed))
    assert set(listed) == keys(RouteRecord)
    assert {"sizing.estimate", "placement.box", "shadow.agrees", "extra"} <= set(listed)


def test_a_record_field_without_a_docstring_fails_the_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    import fusion_graph.cli.docs as docs

    source = inspect.getsource(records).replace('''    """Seconds the answering attempt took."""\n''', "")
    monkeypatch.setattr(inspect, "getsource", lambda _: source)
    with pytest.raises(ValueError, match=r"OutcomeRecord\.latency_s has no attribute docstring"):
        docs.record_table()


# --------------------------------------------------------------------------- README and docs/

DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_USE = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\[([^\[\]]+)\]")
REFERENCE_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(\S+)", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """``text`` without fenced code blocks (kept as blank lines) and inline code."""
    text = FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)
    return CODE_SPAN.sub("code", text)


def anchors(path: Path) -> set[str]:
    """The ``#anchors`` GitHub gives the headings of a markdown file (duplicates get ``-1``, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(f"{slug}-{count}" if count else slug)
    return found


def links(path: Path) -> list[str]:
    """Every link target in a markdown file: inline links and reference definitions."""
    text = prose(path.read_text(encoding="utf-8"))
    return INLINE_LINK.findall(text) + [target for _, target in REFERENCE_DEF.findall(text)]


def broken(path: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``path``) does not resolve, or ``None`` when it does."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        return None  # an address outside the repository
    file, _, anchor = target.partition("#")
    where = (path.parent / file).resolve() if file else path
    if not where.exists():
        return f"{target}: no file {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}"
    if anchor and where.suffix == ".md" and anchor not in anchors(where):
        return f"{target}: no heading #{anchor} in {where.relative_to(ROOT)}"
    return None


def test_the_anchors_are_githubs() -> None:
    page = ROOT / "bench" / "README.md"
    assert "kv-cache-reuse-through-a-gateway-benchkvreusepy---gateway" in anchors(page)
    assert "langgraph-studio--langgraph-dev" in anchors(README)
    assert "docs/configuration.md" in links(README), "the link pattern finds the README's links"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_internal_link_resolves(path: Path) -> None:
    problems = [why for target in links(path) if (why := broken(path, target))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_link_is_defined(path: Path) -> None:
    text = prose(path.read_text(encoding="utf-8"))
    defined = {name.lower() for name, _ in REFERENCE_DEF.findall(text)}
    used = {name.lower() for name in REFERENCE_USE.findall(text)}
    assert used <= defined, f"undefined references: {sorted(used - defined)}"


def test_every_doc_is_reachable_from_the_readme() -> None:
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in links(page):
            file = target.partition("#")[0]
            where = (page.parent / file).resolve()
            if file.endswith(".md") and where.is_relative_to(ROOT / "docs") and where not in reached:
                reached.add(where)
                todo.append(where)
    assert set(DOCS) <= reached, f"not linked from the README or its docs: {sorted(set(DOCS) - reached)}"


def test_the_readme_is_a_first_screen_with_the_ci_test_command() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 350, "reference material belongs in docs/"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = next(line for line in reversed(ci) if line.strip() and not line.startswith("#"))
    blocks = "\n".join(m[0] for m in FENCE.finditer(text))
    assert re.search(rf"^{re.escape(command)}(\s|$)", blocks, re.MULTILINE), (
        f"README.md shows the test command CI runs ({command}) in a code block"
    )


def test_the_deploying_doc_counts_and_names_every_shared_state_table() -> None:
    import fusion_graph.coordination.shared_state as shared_state

    made = re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", shared_state.SCHEMA)
    words = {3: "three", 4: "four", 5: "five", 6: "six"}
    said = " ".join((ROOT / "docs" / "deploying.md").read_text(encoding="utf-8").split())
    assert f"The graph makes {words[len(made)]} tables on first use" in said
    assert all(f"`{table}`" in said for table in made), made
