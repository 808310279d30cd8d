"""``fusion-graph run`` that leaves a memory job pending counts it as pending, not as dropped or failed.

The job's local request is held open by the fake server past the memory wait;
the command then closes its providers and exits. Before, closing the HTTP client
under the running job made a failed connection attempt, an exhausted inference
and a dropped job of it, though its job log entry stays pending and the thread's
next turn runs it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel
from langgraph.store.sqlite import SqliteStore
from prometheus_client import CollectorRegistry

from fusion_graph.cli import memory_wait
from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.stores import store_path
from fusion_graph.context import FusionContext
from fusion_graph.providers.models import build_local_model
from fusion_graph.settings import FusionSettings
from fusion_graph.telemetry import switch
from fusion_graph.telemetry.metrics import Metrics
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import scripted
from tests.unit.cli.test_traces import runner


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """Metrics on, in a registry of the test's own; off again after it."""
    switch.reset()
    fresh = CollectorRegistry()
    switch.ACTIVE.metrics = Metrics(fresh)
    yield fresh
    switch.reset()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The summed value of ``name``'s samples whose labels include ``labels``."""
    return sum(
        s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_job_left_pending_at_exit_counts_as_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry
) -> None:
    never = threading.Event()  # the memory job's answer never comes while the command runs
    try:
        with FakeOpenAI([Reply(content="{}", hold=never)]) as local:
            # The default local model (its HTTP client is the graph's, closed when the command ends).
            model = build_local_model(FusionSettings(local_base_url=local.base_url))

            async def models(
                context: FusionContext, settings: FusionSettings
            ) -> tuple[BaseChatModel, BaseChatModel]:
                return scripted("cloudfake", ["Noted."]), model

            monkeypatch.setattr(cli_run, "MODELS", models)
            monkeypatch.setattr(memory_wait, "MIN_MEMORY_WAIT_S", 0.0)  # wait as long as the answer took
            db = tmp_path / "t.sqlite"
            args = ["run", "My list is in notes.txt", "--workspace", str(tmp_path), "--db", str(db), "--json"]
            result = runner.invoke(app, [*args, "--thread", "t1", "--new-thread"])
            assert result.exit_code == 0, result.output
            assert json.loads(result.stdout)["memory_pending"] is True
            assert local.requests  # the job's request went out, and was left waiting
    finally:
        never.set()
    assert sample(registry, "fusion_memory_jobs_total", outcome="dropped") == 0
    assert sample(registry, "fusion_memory_jobs_total", outcome="pending") >= 1
    assert sample(registry, "fusion_failed_attempts_total") == 0
    assert sample(registry, "fusion_inferences_total", kind="memory") == 0  # none finished, none failed
    assert sample(registry, "fusion_memory_runs_pending") == 0  # nothing runs in the process any more
    # The job log still holds it pending, for the thread's next turn.
    with SqliteStore.from_conn_string(str(store_path(db))) as store:
        logged = [item.value for item in store.search((), limit=50)]
    assert any(value.get("status") == "pending" for value in logged), logged


def test_a_cancelled_job_counts_as_pending_whatever_stopped_it(registry: CollectorRegistry) -> None:
    switch.job_left_pending()
    assert sample(registry, "fusion_memory_jobs_total", outcome="pending") == 1
    assert sample(registry, "fusion_memory_jobs_total", outcome="dropped") == 0
