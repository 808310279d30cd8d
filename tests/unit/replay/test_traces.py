"""Trace helpers: where the traces are, the summary's two shares and its note on plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusion_graph.context import FusionContext
from fusion_graph.providers.pricing import TokenPrices
from fusion_graph.replay.replayed import replay_trajectory, step_costs
from fusion_graph.replay.shares import scored_steps, shares_of
from fusion_graph.replay.summary import is_paced, plan_note, summarize
from fusion_graph.replay.traces import (
    SAMPLE_NAME,
    SAMPLE_TRACES,
    TRACES_ENV,
    StepPrices,
    default_traces,
    families,
    load_trajectories,
    notebook_traces,
    repository_root,
)

REPO = Path(__file__).parents[3]


def make_checkout(root: Path) -> Path:
    """A directory that looks like a fusion-graph checkout, with a traces directory inside it."""
    (root / "repo" / "fusion_graph").mkdir(parents=True)
    (root / "repo" / "pyproject.toml").write_text("[project]\nname = 'fusion-graph'\n")
    (root / "repo" / "notebooks").mkdir()
    traces = root / "repo" / "traces"
    traces.mkdir()
    (traces / "t.jsonl").write_text("{}\n")
    return root / "repo"


def test_repository_root_is_found_from_any_directory_inside_it(tmp_path: Path) -> None:
    repo = make_checkout(tmp_path)
    assert repository_root(repo / "notebooks") == repo
    assert repository_root(repo) == repo
    assert repository_root(REPO / "notebooks") == REPO
    # Outside any checkout: the checkout this package was imported from (an editable install).
    assert repository_root(tmp_path) == REPO


def test_a_notebook_reads_the_bundled_sample_when_no_directory_is_given(tmp_path: Path) -> None:
    repo = make_checkout(tmp_path)
    for environ in ({}, {TRACES_ENV: ""}, {TRACES_ENV: "  "}):
        path, note = notebook_traces(environ, start=repo / "notebooks")
        assert path == SAMPLE_TRACES and SAMPLE_NAME in note


def test_a_notebook_reads_a_relative_directory_from_the_repository_root_not_its_own(tmp_path: Path) -> None:
    repo = make_checkout(tmp_path)
    path, note = notebook_traces({TRACES_ENV: "traces"}, start=repo / "notebooks")
    assert path == (repo / "traces").resolve()
    assert f"read from the repository root {repo.resolve()}" in note and TRACES_ENV in note


def test_a_notebook_reads_an_absolute_directory_as_given(tmp_path: Path) -> None:
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / "x.jsonl").write_text("{}\n")
    path, note = notebook_traces({TRACES_ENV: str(elsewhere)}, start=make_checkout(tmp_path))
    assert path == elsewhere.resolve() and "read as given" in note


def test_a_directory_without_traces_names_the_variable_the_path_and_the_sample(tmp_path: Path) -> None:
    repo = make_checkout(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"traces in FUSION_TRACES_DIR are missing") as given:
        notebook_traces({TRACES_ENV: "nowhere"}, start=repo)
    message = str(given.value)
    assert str((repo / "nowhere").resolve()) in message and f"{TRACES_ENV}=nowhere" in message
    assert SAMPLE_NAME in message and "unset it" in message
    (repo / "traces" / "t.jsonl").unlink()  # a directory with no *.jsonl is as good as missing
    with pytest.raises(FileNotFoundError):
        notebook_traces({TRACES_ENV: "traces"}, start=repo)


def test_the_sample_ships_inside_the_package_and_loads() -> None:
    import fusion_graph

    package = Path(fusion_graph.__file__).resolve().parent
    assert SAMPLE_TRACES.is_relative_to(package)  # the wheel takes the whole package directory
    assert SAMPLE_TRACES.relative_to(package.parent).as_posix() == SAMPLE_NAME
    trajectories = load_trajectories([SAMPLE_TRACES])
    assert set(families(trajectories)) == {"coding-agent", "travel-desk"}
    assert all(t.reward is not None for t in trajectories)


def test_the_default_traces_are_the_variables_else_the_sample(tmp_path: Path) -> None:
    assert default_traces({})[0] == SAMPLE_TRACES
    assert default_traces({TRACES_ENV: " "})[0] == SAMPLE_TRACES  # blank: unset
    path, note = default_traces({TRACES_ENV: str(tmp_path)})
    assert path == tmp_path and TRACES_ENV in note


def tool_call(call_id: str) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": "read", "arguments": "{}"}}


def write_traces(path: Path) -> Path:
    lines = []
    for index in range(6):
        messages: list[dict[str, object]] = []
        for turn in range(1 + index % 2):
            messages.append({"role": "user", "content": f"task {index}.{turn}"})
            for step in range(1 + index % 3):
                messages.append(
                    {"role": "assistant", "content": "", "tool_calls": [tool_call(f"{turn}{step}")]}
                )
                messages.append(
                    {"role": "tool", "tool_call_id": f"{turn}{step}", "content": "z" * 400 * step}
                )
            messages.append({"role": "assistant", "content": "done"})
        lines.append(json.dumps({"id": f"r{index}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


PRICES = StepPrices(TokenPrices(1.0, 2.0, None), TokenPrices(0.1, 0.1, 0.1))


@pytest.mark.parametrize(
    "context", [FusionContext(cloud_share=30), FusionContext(cloud_share=40, pace_slack=0.5)]
)
def test_summary_shows_both_shares_and_says_plans_run_on_cloud(
    tmp_path: Path, context: FusionContext
) -> None:
    replays = [replay_trajectory(t, context) for t in load_trajectories([write_traces(tmp_path / "t.jsonl")])]
    out = summarize(replays, PRICES)
    rows = [s for t in out["trajectories"] for s in t["steps"]]
    plans = [s for s in rows if s["step"] == 0]
    assert out["plan_steps"] == len(plans) == out["steps"] - out["continuation_steps"]
    assert out["plan_cloud_steps"] == len(plans)  # cloud_share > 0: every plan on cloud
    assert out["continuation_cloud_steps"] == sum(s["leg"] == "cloud" for s in rows if s["step"] > 0)
    assert out["cloud_steps"] == out["plan_cloud_steps"] + out["continuation_cloud_steps"]
    assert out["paced_steps"] == sum(s["paced"] for s in rows)
    assert out["note"] == plan_note(out["steps"], len(plans), len(plans))
    assert out["note"].startswith("plans (step 0 of each turn) run on cloud whenever cloud_share > 0: ")
    assert f"{len(plans)} of {out['steps']} steps are plans" in out["note"]
    assert out["cost_fraction"] == round(out["cost_usd"] / out["all_cloud_cost_usd"], 4)
    # The same numbers as calibration's shares (the same routing, the same prices).
    shares = shares_of([scored_steps(r.steps, step_costs(r, PRICES)) for r in replays], context)
    assert (shares.all.steps, shares.all.cloud) == (out["steps"], out["cloud_steps"])
    assert (shares.continuation.steps, shares.continuation.cloud) == (
        out["continuation_steps"],
        out["continuation_cloud_steps"],
    )
    assert shares.cost == pytest.approx(out["cost_usd"])
    assert shares.all_cloud_cost == pytest.approx(out["all_cloud_cost_usd"])
    if context.pace_slack is not None:
        assert out["paced_steps"] > 0
        assert all(
            is_paced(s.decision) == ("; paced to " in s.decision.reason) for r in replays for s in r.steps
        )


def test_plan_note_at_cloud_share_0_says_no_plan_is_on_cloud() -> None:
    note = plan_note(10, 4, 0)
    assert note == (
        "plans (step 0 of each turn) run on cloud whenever cloud_share > 0: 4 of 10 steps are plans, "
        "0 of them on cloud here"
    )
    assert plan_note(10, 4, 4).endswith("so at least 0.40 of all steps go to cloud")


def test_whether_a_step_was_paced_is_never_read_from_its_reason() -> None:
    from fusion_graph.routing.score import RouteDecision

    worded = RouteDecision("cloud", None, None, "score 3 < 60; paced to cloud: words only")
    assert not is_paced(worded)  # the words alone do not make it paced
    silent = RouteDecision("cloud", None, None, "no words about it", paced=True)
    assert is_paced(silent)
