"""``doctor`` says what it observed: the start line ``run`` gives, failures worded as failures,
a cloud URL that is no API, and tools a chat template drops."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

import fusion_graph.cli.doctor.llama as llama
from fusion_graph.cli.app import app
from fusion_graph.cli.checks import first_prompt_tokens
from fusion_graph.cli.doctor.cloud import FoundKey, cloud_completion_check, cloud_models_check
from fusion_graph.cli.doctor.props import props_checks, template_check, window_check
from fusion_graph.context import FusionContext
from fusion_graph.providers.llama_server import (
    RECOMMENDED_SLOT_WINDOW,
    ServerProps,
    slot_window_for,
    start_command,
)
from fusion_graph.routing.rule import LinkRoom, fits
from fusion_graph.settings import FusionSettings
from fusion_graph_testing import free_port
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.unit.cli.test_traces import runner

START = re.compile(r"llama-server -m MODEL\.gguf --jinja -np (\d+) -c (\d+) --port (\d+)")
KEY = FoundKey("OPENAI_API_KEY", "environment", True, "findings-key")


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", KEY.value)


def checks_of(*args: str) -> dict[str, dict[str, str]]:
    result = runner.invoke(app, ["doctor", "--json", *args])
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


# --------------------------------------------------------------------------- one start line


@pytest.mark.parametrize("budget", [256, 4096, 8192])
def test_run_and_doctor_give_one_start_line_whose_slots_hold_the_first_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    port = free_port()
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", f"http://127.0.0.1:{port}/v1")
    context = json.dumps({"max_completion_tokens": budget})
    run = runner.invoke(app, ["run", "hi", "--workspace", str(tmp_path), "--context", context])
    assert run.exit_code == 2
    said = " ".join(run.stderr.split())
    assert len(START.findall(said)) == 1 and said.count("start one with") == 0  # the fix, once
    doctor = checks_of("--context", context, "--timeout", "1")["llama-server"]
    assert doctor["status"] == "fail"
    in_run, in_doctor = START.search(said), START.search(doctor["fix"])
    assert in_run is not None and in_doctor is not None and in_run[0] == in_doctor[0]
    slots, total, listens = map(int, in_run.groups())
    assert listens == port  # where FUSION_LOCAL_BASE_URL points, not llama-server's default
    window = total // slots
    prompt = first_prompt_tokens(FusionContext(max_completion_tokens=budget), FusionSettings())
    assert window == max(RECOMMENDED_SLOT_WINDOW, slot_window_for(budget, prompt)) >= 2 * budget
    # the first prompt fits beside the budget
    assert fits(LinkRoom("local:m", "local", window, prompt), budget)


def test_the_start_line_listens_where_the_url_points() -> None:
    assert start_command().endswith("-np 4 -c 131072 --port 8080")
    assert start_command(base_url="http://127.0.0.1:8093/v1").endswith("--port 8093")
    assert start_command(base_url="http://gpu-box:9000/v1").endswith("--host 0.0.0.0 --port 9000")
    assert start_command(base_url="http://localhost/v1").endswith("--port 8080")
    # More than the recommended window when the run needs it.
    assert "-np 2 -c 131072 " in start_command(32768, slots=2)


def test_the_docs_show_the_start_line_doctor_and_run_give() -> None:
    root = Path(__file__).parents[3]
    line = start_command()
    for doc in ("README.md", "docs/deploying.md"):
        shown = re.findall(r"llama-server -m MODEL\.gguf[^\n&`]*", (root / doc).read_text())
        assert shown and all(found.strip() == line for found in shown), (doc, shown)


# --------------------------------------------------------------------------- the slot window


def test_a_slot_window_failure_says_what_fails() -> None:
    settings = FusionSettings()
    prompt = first_prompt_tokens(FusionContext(), settings)
    # 512 tokens per slot (-c 2048 -np 4) and a 256-token budget: the first prompt does not fit.
    tiny = window_check(ServerProps(4, 512), settings, 256, prompt_tokens=prompt)
    assert tiny.status == "fail" and "no local step fits" in tiny.detail and f"about {prompt}" in tiny.detail
    assert "-c 131072" in tiny.fix and "-c 2048" not in tiny.fix
    # Under 2 x the budget: local answers are cut, a failure worded as one.
    half = window_check(ServerProps(4, 4096), settings, 4096, prompt_tokens=prompt)
    assert (
        half.status == "fail"
        and "local answers stop at 2048 tokens" in half.detail
        and "cut off" in half.detail
    )
    roomy = window_check(ServerProps(4, 8192), settings, 4096, prompt_tokens=prompt)
    assert roomy.status == "ok" and "4096 left for prompts" in roomy.detail


# --------------------------------------------------------------------------- a cloud URL that is no API


HTML = b"<!DOCTYPE html><html><head><title>Welcome</title></head><body>Sign in</body></html>"


@pytest.fixture
def web_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A loopback server answering every request with an HTML page (a site, not an API)."""

    class Page(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def _page(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(HTML)))
            self.end_headers()
            self.wfile.write(HTML)

        def do_GET(self) -> None:
            self._page(200)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._page(405)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    monkeypatch.setenv("FUSION_CLOUD_BASE_URL", url)
    yield url
    server.shutdown()
    server.server_close()


def test_an_html_cloud_url_fails_as_not_an_api(web_page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", f"http://127.0.0.1:{port}/v1")
    for args in ([], ["--live"]):
        result = runner.invoke(app, ["doctor", "--json", "--timeout", "2", *args])
        assert result.exit_code == 1
        found = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
        endpoint = found["cloud endpoint"]
        assert endpoint["status"] == "fail"
        assert "an HTML page" in endpoint["detail"] and "not an OpenAI-compatible API" in endpoint["detail"]
        assert "quota" not in result.stdout


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (Reply(status=405, raw=HTML), "with an HTML page"),
        (Reply(status=200, raw=b"hello"), "not an OpenAI-compatible API"),
        (Reply(status=404, raw=b'{"error": {"message": "The model does not exist"}}'), "not found: HTTP 404"),
        (Reply(status=429, raw=b'{"error": {"message": "You exceeded your current quota"}}'), "out of quota"),
        (Reply(status=400, raw=b'{"error": {"message": "max_tokens too small"}}'), "request was refused"),
    ],
)
def test_the_live_completion_goes_through_ask_and_reads_its_failed_attempt(
    reply: Reply, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY.value)
    with FakeOpenAI() as cloud:
        monkeypatch.setenv("FUSION_CLOUD_BASE_URL", cloud.base_url)
        cloud.script([reply])
        completion = cloud_completion_check(FusionSettings(cloud_model="fake"), KEY, timeout=5)
        assert said in completion.detail, completion
        assert completion.status in ("fail", "warn") and "quota" not in completion.fix.replace(
            "account's quota", ""
        )
        assert cloud.requests[-1]["max_completion_tokens"] == 1  # the body the graph sends
        cloud.script([Reply(content="ok")])
        assert cloud_completion_check(FusionSettings(cloud_model="fake"), KEY, timeout=5).status == "ok"


def test_a_non_json_model_list_is_not_an_api() -> None:
    plain = httpx.Response(200, text="hello", headers={"Content-Type": "text/plain"})
    client = httpx.Client(transport=httpx.MockTransport(lambda request: plain))
    models = cloud_models_check(FusionSettings(), KEY, client, "http://h/v1")
    assert models.status == "fail" and "text/plain that is not JSON" in models.detail


# --------------------------------------------------------------------------- tools the template drops


def test_the_chat_template_row_says_what_apply_template_rendered() -> None:
    caps_off = {"chat_template_caps": {"supports_tools": False}}
    dropped = template_check(caps_off, "<|im_start|>user\nhi<|im_end|>")
    assert dropped.status == "fail" and "rendered a prompt without it" in dropped.detail
    assert "falls back" not in dropped.detail
    added = template_check(caps_off, 'Tools: [{"name": "doctor_probe"}] user: hi')
    assert added.status == "warn" and "wrote the probe tool into the prompt itself" in added.detail
    says_yes = template_check({"chat_template_caps": {"supports_tools": True}}, "user: hi")
    assert says_yes.status == "fail" and "supports_tools=true, but" in says_yes.detail
    rows = props_checks(ServerProps(4, 8192), caps_off, (200, "user: hi"), FusionSettings(), 1024)
    assert {r.name: r.status for r in rows}["chat template"] == "fail"


def test_doctor_reports_a_tool_the_server_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeOpenAI() as cloud, FakeOpenAI() as server:
        server.props = {
            "total_slots": 4,
            "default_generation_settings": {"n_ctx": 8192},
            "chat_template_caps": {"supports_tools": False},
        }
        monkeypatch.setenv("FUSION_CLOUD_BASE_URL", cloud.base_url)
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", server.base_url)
        # what llama-server's POST /apply-template answers when the template leaves the tools out
        monkeypatch.setattr(llama, "_tools_probe", lambda client, root: (200, "<|im_start|>user\nhi"))
        row = checks_of()["chat template"]
    assert row["status"] == "fail" and "never sees the tools" in row["detail"]
