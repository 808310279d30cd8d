"""The README's code runs as written: its Python block is ``examples/quickstart.py``, run here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fusion_graph_testing.fake_openai import FakeOpenAI, Reply

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def run_example(
    example: Path,
    where: Path,
    cloud_url: str,
    local_url: str,
    *,
    openai_key: str | None = "sk-example-key-000000",
    **more: str,
) -> subprocess.CompletedProcess[str]:
    """Run ``example`` in ``where`` as a newcomer would, against these servers (no other FUSION_ setting).

    ``openai_key``: the ``OPENAI_API_KEY`` it finds; ``None`` leaves that variable unset (a key
    given another way, ``FUSION_CLOUD_API_KEY`` in ``more``).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_") and k != "OPENAI_API_KEY"}
    if openai_key is not None:
        env["OPENAI_API_KEY"] = openai_key
    env |= {"FUSION_CLOUD_BASE_URL": cloud_url, "FUSION_LOCAL_BASE_URL": local_url, **more}
    return subprocess.run(
        [sys.executable, str(example)], cwd=where, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_readme_shows_the_quickstart_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"```python\n{EXAMPLE.read_text(encoding='utf-8')}```" in readme


def test_the_quickstart_example_runs_against_openai_compatible_servers(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a note\n", encoding="utf-8")
    plan = Reply(content="", tool_calls=[("list_dir", {"path": "."})])
    with FakeOpenAI([plan]) as cloud, FakeOpenAI([Reply(content="A project with one note.")]) as local:
        done = run_example(EXAMPLE, tmp_path, cloud.base_url, local.base_url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "A project with one note."
    assert lines[1].startswith("0 plan cloud -> cloud")
    assert any(line.startswith("1 step local -> local") for line in lines)


def test_the_quickstart_shows_where_a_step_was_routed_and_where_it_ran(tmp_path: Path) -> None:
    from fusion_graph_testing.llama_server import free_port

    plan = Reply(content="", tool_calls=[("list_dir", {"path": "."})])
    dead = f"http://127.0.0.1:{free_port()}/v1"  # llama-server is down: the local step falls over to cloud
    with FakeOpenAI([plan, Reply(content="Answered by cloud.")]) as cloud:
        done = run_example(EXAMPLE, tmp_path, cloud.base_url, dead)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Answered by cloud."
    assert any(line.startswith("1 step local -> cloud cloud:") for line in lines), lines


AGENT_EXAMPLE = ROOT / "examples" / "create_agent_fusion.py"


def test_the_create_agent_example_routes_each_model_call(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a note\n", encoding="utf-8")
    plan = Reply(content="", tool_calls=[("list_dir", {"path": "."})])
    with FakeOpenAI([plan]) as cloud, FakeOpenAI([Reply(content="A project with one note.")]) as local:
        done = run_example(AGENT_EXAMPLE, tmp_path, cloud.base_url, local.base_url, FUSION_LOCAL_SLOTS="4")
        slots = {body.get("id_slot") for body in local.requests}
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "A project with one note."
    assert lines[1].startswith("0 plan cloud -> cloud")
    assert any(line.startswith("1 step local -> local") for line in lines)
    assert len(slots) == 1 and None not in slots  # the local call carried the thread's slot


def test_the_create_agent_example_takes_the_key_the_settings_take(tmp_path: Path) -> None:
    """``FUSION_CLOUD_API_KEY`` alone (the docs allow it): the agent's own model has the key too."""
    plan = Reply(content="", tool_calls=[("list_dir", {"path": "."})])
    key = "sk-fusion-setting-key-0000"
    with FakeOpenAI([plan]) as cloud, FakeOpenAI([Reply(content="Listed.")]) as local:
        done = run_example(
            AGENT_EXAMPLE,
            tmp_path,
            cloud.base_url,
            local.base_url,
            openai_key=None,
            FUSION_CLOUD_API_KEY=key,
            FUSION_LOCAL_SLOTS="4",
        )
        sent = [headers.get("authorization") for headers in cloud.request_headers]
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "Listed."
    assert sent == [f"Bearer {key}"]
