"""What the CLI and the package say reads right: lines wrap between words, counts agree with
their nouns, a misspelt run-context key gets a suggestion, and a calibrated share far from its
target is called off target.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from fusion_graph.cli.app import app
from fusion_graph.cli.doctor.cloud import FoundKey, cloud_models_check
from fusion_graph.context import ensure_context
from fusion_graph.errors import ChainExhausted, ContextError
from fusion_graph.replay.calibration import TARGET_TOLERANCE, target_verdict
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.served import graph_over
from tests.unit.cli.test_traces import runner

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: A terminal 80 columns wide, without colours (rich still writes bold).
TERMINAL = {"TTY_COMPATIBLE": "1", "NO_COLOR": "1", "COLUMNS": "80"}


def missing_db_error(db: Path, env: dict[str, str] | None = None) -> str:
    """``report``'s one-sentence error about a missing ``db``, as printed (escape codes removed)."""
    result = runner.invoke(app, ["report", "--db", str(db)], env=env)
    assert result.exit_code == 2
    return ANSI.sub("", result.stderr)


def test_a_sentence_wraps_between_words_at_an_80_column_terminal(tmp_path: Path) -> None:
    long_name = "a-directory-whose-name-is-longer-than-a-whole-line-of-an-eighty-column-terminal-" * 2
    db = tmp_path / long_name / "threads.sqlite"
    piped = missing_db_error(db)
    assert piped.count("\n") == 1, "off a terminal the sentence stays one line"
    shown = missing_db_error(db, TERMINAL)
    lines = shown.splitlines()
    assert len(lines) > 1
    # Every line break replaced a space: no word was cut, and the long path is whole on its line.
    assert " ".join(lines) == piped.rstrip("\n")
    assert all(len(line) <= 80 or " " not in line.strip() for line in lines), lines
    assert str(db) + ":" in lines


async def test_an_exhausted_chain_counts_its_failures_in_english() -> None:
    down = Reply(content="x", status=500)
    with FakeOpenAI([down]) as cloud, FakeOpenAI([down]) as local, pytest.raises(ChainExhausted) as raised:
        graph = graph_over(cloud, local)
        await graph.ainvoke(
            user_input("hi"), {"configurable": {"thread_id": "t"}}, context={"sub_runners": "off"}
        )
    text = str(raised.value)
    assert "(2 failed attempts)" in text
    assert "still available (1 recent failure)" in text
    assert "1 recent failures" not in text


@pytest.mark.parametrize(
    ("models", "says"), [(["a"], "its 1 model does not include"), (["a", "b"], "its 2 models do not include")]
)
def test_doctor_says_its_model_count_with_the_verb_that_agrees(models: list[str], says: str) -> None:
    listing = {"data": [{"id": name} for name in models]}
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=listing)))
    key = FoundKey("OPENAI_API_KEY", "environment", True, "sk-test-key-0000")
    check = cloud_models_check(FusionSettings(cloud_model="gpt-x"), key, client, "http://h/v1")
    assert check.status == "warn" and says in check.detail


def test_an_unknown_context_key_gets_the_name_it_likely_misspells() -> None:
    with pytest.raises(
        ContextError, match=r"cloud_shar: Unexpected keyword argument \(did you mean 'cloud_share'\?\)"
    ):
        ensure_context({"cloud_shar": 40})
    with pytest.raises(ContextError) as far:
        ensure_context({"zzzz": 1})
    assert "did you mean" not in str(far.value)
    result = runner.invoke(app, ["replay", "--context", '{"max_step": 5}'])
    assert result.exit_code == 2
    assert "did you mean 'max_steps'?" in result.stderr


def test_an_achieved_share_far_from_its_target_is_called_off_target() -> None:
    assert (
        target_verdict(0.10, 0.55) == f"off target: 0.45 above it, past the {TARGET_TOLERANCE:.2f} tolerance"
    )
    assert target_verdict(0.40, 0.30).startswith("off target: 0.10 below it")
    assert target_verdict(0.10, 0.12) == f"on target, within the {TARGET_TOLERANCE:.2f} tolerance"
    far = runner.invoke(app, ["calibrate", "--target-cloud-fraction", "0.35", "--pace-slack", "0"])
    assert far.exit_code == 0, far.output
    assert re.search(r"achieved 0\.\d+ of continuation steps for the target 0\.350: off target", far.stdout)
