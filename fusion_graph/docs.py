"""Documentation generated from the code, so the README cannot drift from it."""

from __future__ import annotations

from fusion_graph.context import ENV_PREFIX, context_fields

TABLE_BEGIN = "<!-- config-table:begin -->"
TABLE_END = "<!-- config-table:end -->"


def config_table() -> str:
    """The README's configuration table, one row per ``FusionContext`` field."""
    rows = [
        "| field | type | default | environment | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, kind, default, description in context_fields():
        shown = repr(default) if not isinstance(default, str) or len(default) < 40 else "(see prompts.py)"
        env = ENV_PREFIX + name.upper()
        kind = kind.replace("|", "or")
        rows.append(f"| `{name}` | {kind} | `{shown}` | `{env}` | {description} |")
    return "\n".join(rows)


def render_readme_table(readme: str) -> str:
    """``readme`` with the text between the table markers replaced by :func:`config_table`."""
    head, rest = readme.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{config_table()}\n{TABLE_END}{tail}"


if __name__ == "__main__":  # python -m fusion_graph.docs README.md
    import sys
    from pathlib import Path

    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    path.write_text(render_readme_table(path.read_text(encoding="utf-8")), encoding="utf-8")
