"""Recorded agent trajectories: load them, replay them with the graph's routing, summarise.

A trace file is JSONL, one conversation per line:
``{"id", "messages": [OpenAI chat messages], "reward"?, ...}``. Every assistant
message is one step. Replays run ``replay.route_history`` (the graph's own
routing, no model calls). Token counts are estimates (``signals.approximate_tokens``):
a step's prompt is what it would send, its completion the recorded assistant
message; costs price those estimates with no cached tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, convert_to_messages

from fusion_graph.budget import CloudBudget, CloudSpend, cloud_budget, over_budget
from fusion_graph.context import FusionContext
from fusion_graph.errors import TraceError
from fusion_graph.providers.pricing import TokenPrices, default_pricing, unit_prices
from fusion_graph.replay.history import ReplayedStep, route_history
from fusion_graph.routing import RouteDecision
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.tokens import approximate_tokens

#: Where the shared traces live, relative to the repository root (``../shared/data/traces``).
SHARED_TRACES = Path("..") / "shared" / "data" / "traces"
#: The environment variable naming the traces directory (notebooks, ``shared_traces``).
TRACES_ENV = "FUSION_TRACES_DIR"


def repository_root(start: Path | None = None) -> Path | None:
    """The fusion-graph checkout holding ``start`` (default: the working directory), or ``None``.

    The first of ``start`` and its parents that holds both ``pyproject.toml`` and
    the ``fusion_graph`` package; failing that, the checkout this package was
    imported from (an editable install), if it is one.
    """
    here = (start or Path.cwd()).resolve()
    package = Path(__file__).resolve().parents[2]
    for candidate in (here, *here.parents, package):
        if (candidate / "pyproject.toml").is_file() and (candidate / "fusion_graph").is_dir():
            return candidate
    return None


def shared_traces(environ: Mapping[str, str] | None = None, *, start: Path | None = None) -> Path:
    """The traces directory: ``$FUSION_TRACES_DIR``, else ``shared/data/traces`` beside the repository root.

    A relative ``FUSION_TRACES_DIR`` is read from the working directory. The
    default does not depend on the working directory (a notebook's, a shell's):
    it is ``SHARED_TRACES`` resolved against ``repository_root(start)``.

    Raises:
        FileNotFoundError: The directory holds no ``*.jsonl`` file; the message
            names the path and ``FUSION_TRACES_DIR``.
    """
    environ = os.environ if environ is None else environ
    given = environ.get(TRACES_ENV, "").strip()
    if given:
        path, origin = Path(given).expanduser(), f"from {TRACES_ENV}"
    else:
        root = repository_root(start)
        path = (root / SHARED_TRACES) if root is not None else SHARED_TRACES
        origin = f"the default, {SHARED_TRACES} beside the repository root; set {TRACES_ENV} to change it"
    path = path.resolve()
    if not path.is_dir() or not any(path.glob("*.jsonl")):
        raise FileNotFoundError(
            f"the shared traces are missing: no *.jsonl files in {path} ({origin}). "
            f"Point {TRACES_ENV} at a directory of OpenAI-format JSONL traces."
        )
    return path


@dataclass(frozen=True)
class RecordedTrajectory:
    """One recorded conversation."""

    file: str
    """Stem of its trace file; trajectories of one file form a family."""
    line: int
    id: str
    reward: float | None
    """Task outcome when the source records one (tau-bench: 1 success, 0 failure)."""
    messages: tuple[BaseMessage, ...]


def trace_files(paths: Iterable[Path]) -> list[Path]:
    """Expand directories to their ``*.jsonl`` files (sorted); files are taken as given.

    Raises:
        TraceError: A path does not exist, or no trace file was found.
    """
    paths = list(paths)
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(path.glob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        else:
            raise TraceError(
                f"trace path not found: {path} (the shared traces live in {SHARED_TRACES} "
                "beside the repository root)"
            )
    if not found:
        raise TraceError(f"no *.jsonl trace files in {', '.join(map(str, paths))}")
    return found


@dataclass(frozen=True)
class TraceRecord:
    """One JSONL trace record as stored: OpenAI chat messages, unconverted."""

    file: str
    line: int
    id: str | None
    """The record's own ``id`` (``None`` when it has none)."""
    reward: float | None
    messages: tuple[dict[str, Any], ...]


def parse_records(lines: Iterable[str], *, file: str) -> list[TraceRecord]:
    """Parse JSONL records ``{"id", "messages": [...], "reward"?}``; blank lines are skipped.

    Raises:
        TraceError: A line is not JSON or has no list of role-tagged messages.
    """
    found = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{file}:{number}: not JSON ({error})") from error
        raw = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(raw, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in raw
        ):
            raise TraceError(f"{file}:{number}: expected a 'messages' list of {{'role': ...}} objects")
        reward = record.get("reward")
        found.append(
            TraceRecord(
                file=file,
                line=number,
                id=str(record["id"]) if record.get("id") else None,
                reward=float(reward) if isinstance(reward, int | float) else None,
                messages=tuple(raw),
            )
        )
    return found


def parse_trajectories(lines: Iterable[str], *, file: str) -> list[RecordedTrajectory]:
    """Parse JSONL trace records (``parse_records``) into conversations of LangChain messages.

    Raises:
        TraceError: A line is not a trace record, or its messages cannot be read.
    """
    found = []
    for record in parse_records(lines, file=file):
        try:
            messages = convert_to_messages(list(record.messages))
        except (ValueError, TypeError, KeyError) as error:
            raise TraceError(f"{file}:{record.line}: unreadable messages ({error})") from error
        found.append(
            RecordedTrajectory(
                file=file,
                line=record.line,
                id=record.id or f"{file}:{record.line}",
                reward=record.reward,
                messages=tuple(messages),
            )
        )
    return found


def load_trajectories(paths: Iterable[Path]) -> list[RecordedTrajectory]:
    """Every trajectory of every trace file under ``paths`` (files or directories)."""
    found = []
    for path in trace_files(paths):
        with path.open(encoding="utf-8") as handle:
            found.extend(parse_trajectories(handle, file=path.stem))
    return found


def families(trajectories: Iterable[RecordedTrajectory]) -> dict[str, list[RecordedTrajectory]]:
    """Trajectories grouped by trace file, in first-seen order."""
    grouped: dict[str, list[RecordedTrajectory]] = {}
    for trajectory in trajectories:
        grouped.setdefault(trajectory.file, []).append(trajectory)
    return grouped


# -- replay and summary ---------------------------------------------------------


@dataclass(frozen=True)
class StepPrices:
    """Per-million prices to price replayed steps: cloud (``None``: unknown) and local."""

    cloud: TokenPrices | None
    local: TokenPrices


def step_prices(settings: FusionSettings, cloud_model: str | None = None) -> StepPrices:
    """The cloud model's prices (``price_overrides`` or the catalogue) and the local price.

    Args:
        settings: The operator's settings (prices, cloud endpoint).
        cloud_model: The run's model; ``None`` is the operator's ``cloud_model``.
    """
    model = cloud_model or settings.cloud_model
    overrides = {
        key: TokenPrices(input=value[0], output=value[1], cached_input=value[2])
        for key, value in settings.price_overrides.items()
    }
    pricing = default_pricing(
        provider_id=f"cloud:{model}",
        leg="cloud",
        model_ref=model,
        api_url=settings.cloud_base_url,
        overrides=overrides,
        price_like=settings.cloud_price_like,
    )
    local_in, local_out = settings.local_price_per_mtok
    return StepPrices(unit_prices(pricing), TokenPrices(local_in, local_out, local_in))


@dataclass(frozen=True)
class ReplayedTrajectory:
    """A trajectory routed step by step, with each step's estimated completion tokens."""

    trajectory: RecordedTrajectory
    steps: tuple[ReplayedStep, ...]
    completion_tokens: tuple[int, ...]
    context: FusionContext | None = None
    """The run context it was replayed under (``None``: unknown, as in hand-built replays)."""
    priced: bool = False
    """Whether cloud steps were priced while routing, so the context's cloud budgets applied."""


def cloud_cost_of(prices: StepPrices) -> Callable[[int, int], float | None]:
    """``route_history``'s ``cloud_cost``: a step's cloud price, ``None`` when the cloud price is unknown."""
    cloud = prices.cloud

    def cost(prompt: int, completion: int) -> float | None:
        return None if cloud is None else cloud.cost(prompt, 0, completion)

    return cost


def replay_trajectory(
    trajectory: RecordedTrajectory, context: FusionContext, prices: StepPrices | None = None
) -> ReplayedTrajectory:
    """Route every assistant message of ``trajectory`` under ``context`` (no model calls).

    With ``prices``, cloud steps are priced as they are routed, so the context's
    cloud budgets (``turn_cloud_budget_usd``, ``thread_cloud_budget_usd``) apply
    by the graph's rule (``route_history``); without, no budget applies.
    """
    cloud_cost = cloud_cost_of(prices) if prices is not None else None
    steps = route_history(trajectory.messages, context, cloud_cost=cloud_cost)
    completions = tuple(approximate_tokens([trajectory.messages[s.position]]) for s in steps)
    return ReplayedTrajectory(trajectory, tuple(steps), completions, context, prices is not None)


def replay_all(
    trajectories: Sequence[RecordedTrajectory],
    context: FusionContext,
    *,
    advance: Callable[[], None] | None = None,
    prices: StepPrices | None = None,
) -> list[ReplayedTrajectory]:
    """``replay_trajectory`` for each, calling ``advance`` after each one (a progress bar)."""
    replays = []
    for trajectory in trajectories:
        replays.append(replay_trajectory(trajectory, context, prices))
        if advance is not None:
            advance()
    return replays


def _cost(prices: TokenPrices | None, prompt: int, completion: int) -> float | None:
    return None if prices is None else prices.cost(prompt, 0, completion)


def step_costs(replay: ReplayedTrajectory, prices: StepPrices) -> list[tuple[float | None, float]]:
    """Each step's ``(cloud, local)`` cost in USD, as ``summarize`` prices it (for cost targets).

    The cloud cost is ``None`` when the cloud model's price is unknown.
    """
    costs = []
    for item, completion in zip(replay.steps, replay.completion_tokens, strict=True):
        prompt = item.signals.prompt_tokens
        costs.append((_cost(prices.cloud, prompt, completion), prices.local.cost(prompt, 0, completion)))
    return costs


#: What ``routing`` appends to a decision's reason when the paced dial overruled the band.
PACED_MARK = "; paced to "


def is_paced(decision: RouteDecision) -> bool:
    """Whether the paced dial (``routing.paced_leg``) forced this leg against the score's band."""
    return PACED_MARK in decision.reason


def plan_note(steps: int, plans: int, plans_on_cloud: int) -> str:
    """The line that explains the gap between the share of all steps and of continuation steps."""
    note = (
        f"plans (step 0 of each turn) run on cloud whenever cloud_share > 0: {plans} of {steps} "
        f"steps are plans, {plans_on_cloud} of them on cloud here"
    )
    if plans and plans_on_cloud == plans:
        note += f", so at least {plans / steps:.2f} of all steps go to cloud"
    return note


def _fraction(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def _add(total: float | None, value: float | None) -> float | None:
    return None if total is None or value is None else total + value


def _ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def replay_budget(replay: ReplayedTrajectory) -> CloudBudget:
    """The cloud budget that applied to a replay (none unless it was priced while routing)."""
    context = replay.context
    if context is None or not replay.priced:
        return CloudBudget()
    return cloud_budget(
        operator_turn=None,
        operator_thread=None,
        run_turn=context.turn_cloud_budget_usd,
        run_thread=context.thread_cloud_budget_usd,
    )


def budget_dict(budget: CloudBudget) -> dict[str, float | None]:
    """A budget for JSON: ``{"turn_usd", "thread_usd"}`` (``None``: no limit)."""
    return {"turn_usd": budget.turn_usd, "thread_usd": budget.thread_usd}


#: Tokens of the re-synthesis instruction (``prompts.RESYNTHESIZE``) added to the reply's prompt, roughly.
RESYNTHESIS_PROMPT_TOKENS = 30


@dataclass(frozen=True)
class ResynthesisCount:
    """What ``resynthesize="local_replies"`` would add to one replay.

    A turn ends at its last assistant message (before the next user message or
    the end of the trajectory). A turn ending on a reply (no tool calls) the
    local leg wrote gets one cloud call: its prompt is that step's prompt plus
    the instruction, its completion the reply's tokens. With a budget, the call
    is priced before it (prompt plus ``max_completion_tokens``) against the
    spend so far (cloud steps and earlier re-syntheses) and skipped when over.
    """

    turns: int = 0
    local_endings: int = 0
    """Turns ending on a local reply (what the graph would re-write)."""
    done: int = 0
    skipped: int = 0
    """Re-syntheses the budget would skip (the local reply stands)."""
    cost_usd: float | None = 0.0
    """Cloud cost the done ones add (``None``: the cloud price is unknown)."""

    def __add__(self, other: ResynthesisCount) -> ResynthesisCount:
        return ResynthesisCount(
            self.turns + other.turns,
            self.local_endings + other.local_endings,
            self.done + other.done,
            self.skipped + other.skipped,
            _add(self.cost_usd, other.cost_usd),
        )


def _resynthesizes(context: FusionContext | None) -> bool:
    """Whether the graph would re-write local replies in a run of ``context`` if asked (any cloud at all)."""
    if context is None:
        return True
    return context.mode != "local" and not (context.mode == "fusion" and context.cloud_share == 0)


def resynthesis_count(replay: ReplayedTrajectory, prices: StepPrices) -> ResynthesisCount:
    """What re-synthesis of local replies would add to ``replay`` (see ``ResynthesisCount``)."""
    budget = replay_budget(replay)
    context = replay.context
    max_completion = (context or FusionContext()).max_completion_tokens
    applies = _resynthesizes(context)
    turns = endings = done = skipped = 0
    added: float | None = 0.0
    thread_spend = turn_spend = 0.0
    steps = replay.steps
    for index, (item, completion) in enumerate(zip(steps, replay.completion_tokens, strict=True)):
        if item.step == 0:
            turn_spend = 0.0
        prompt = item.signals.prompt_tokens
        if item.leg == "cloud":
            spent = _cost(prices.cloud, prompt, completion) or 0.0
            thread_spend, turn_spend = thread_spend + spent, turn_spend + spent
        if index + 1 < len(steps) and steps[index + 1].step > 0:
            continue  # not the turn's last step
        turns += 1
        message = replay.trajectory.messages[item.position]
        if item.leg != "local" or (isinstance(message, AIMessage) and message.tool_calls):
            continue
        endings += 1
        if not applies:
            continue
        asked = prompt + RESYNTHESIS_PROMPT_TOKENS
        estimate = _cost(prices.cloud, asked, max_completion)
        if over_budget(budget, CloudSpend(turn_spend, thread_spend), estimate) is not None:
            skipped += 1
            continue
        done += 1
        cost = _cost(prices.cloud, asked, completion)
        added = _add(added, cost)
        thread_spend, turn_spend = thread_spend + (cost or 0.0), turn_spend + (cost or 0.0)
    return ResynthesisCount(turns, endings, done, skipped, added)


def resynthesis_summary(
    count: ResynthesisCount, cloud_cost: float | None, all_cloud: float | None
) -> dict[str, Any]:
    """The ``resynthesis`` object of ``summarize``: counts, added cost and its fractions."""
    return {
        "turns": count.turns,
        "turns_ending_local": count.local_endings,
        "resynthesized": count.done,
        "skipped_by_budget": count.skipped,
        "instruction_tokens": RESYNTHESIS_PROMPT_TOKENS,
        "added_cost_usd": count.cost_usd,
        "fraction_of_cloud_cost": _ratio(count.cost_usd, cloud_cost),
        "fraction_of_all_cloud_cost": _ratio(count.cost_usd, all_cloud),
    }


def summarize(replays: Sequence[ReplayedTrajectory], prices: StepPrices) -> dict[str, Any]:
    """The ``replay --json`` object: counts, fractions, switches, costs, budget, re-synthesis and every step.

    ``cloud_fraction`` is the share of all steps on cloud, ``continuation_cloud_fraction``
    the share of continuation steps (after each turn's plan); plans run on cloud
    whenever ``cloud_share > 0``, which ``note`` says with the counts (``plan_steps``,
    ``plan_cloud_steps``). ``paced_steps`` counts the steps the paced dial forced onto
    the other leg. ``switches`` counts leg changes between consecutive steps of a
    trajectory (plan steps included). Costs price the estimated tokens with no cached
    input; ``None`` when the cloud model's price is unknown; ``cost_fraction`` is
    ``cost_usd / all_cloud_cost_usd``; ``cloud_cost_usd`` is the cloud steps' part.

    ``budget`` is the cloud budget the replays ran under (``"per_trajectory"`` when
    they differ; each trajectory has its own), ``budget_local_steps`` the steps it
    moved local (``budget_local_plan_steps`` of them plans). ``resynthesis`` is what
    ``resynthesize="local_replies"`` would add (``resynthesis_count``), whatever the
    context's own setting.
    """
    steps = cloud_steps = continuation = continuation_cloud = switches = paced = 0
    moved = moved_plans = 0
    cost: float | None = 0.0
    cloud_cost: float | None = 0.0
    all_cloud: float | None = 0.0
    again = ResynthesisCount()
    budgets: set[CloudBudget] = set()
    trajectories = []
    for replay in replays:
        legs = [s.leg for s in replay.steps]
        switches += sum(a != b for a, b in pairwise(legs))
        budget = replay_budget(replay)
        budgets.add(budget)
        rows = []
        own_cost: float | None = 0.0
        own_cloud: float | None = 0.0
        own_all_cloud: float | None = 0.0
        own_moved = 0
        for item, completion in zip(replay.steps, replay.completion_tokens, strict=True):
            decision = item.decision
            prompt = item.signals.prompt_tokens
            step_cost = _cost(prices.cloud if item.leg == "cloud" else prices.local, prompt, completion)
            own_cost = _add(own_cost, step_cost)
            if item.leg == "cloud":
                own_cloud = _add(own_cloud, step_cost)
            own_all_cloud = _add(own_all_cloud, _cost(prices.cloud, prompt, completion))
            steps += 1
            cloud_steps += item.leg == "cloud"
            paced += is_paced(decision)
            budget_local = decision.budget is not None
            own_moved += budget_local
            moved_plans += budget_local and item.step == 0
            if item.step > 0:
                continuation += 1
                continuation_cloud += item.leg == "cloud"
            score = decision.score
            rows.append(
                {
                    "position": item.position,
                    "step": item.step,
                    "leg": item.leg,
                    "paced": is_paced(decision),
                    "budget_local": budget_local,
                    "score": score.score if score is not None else None,
                    "points": score.points if score is not None else None,
                    "breakdown": score.breakdown() if score is not None else None,
                    "threshold": decision.threshold,
                    "reason": decision.reason,
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "cost_usd": step_cost,
                }
            )
        moved += own_moved
        cost, cloud_cost, all_cloud = (
            _add(cost, own_cost),
            _add(cloud_cost, own_cloud),
            _add(all_cloud, own_all_cloud),
        )
        own_again = resynthesis_count(replay, prices)
        again += own_again
        trajectory = replay.trajectory
        trajectories.append(
            {
                "id": trajectory.id,
                "file": trajectory.file,
                "reward": trajectory.reward,
                "budget": budget_dict(budget),
                "cost_usd": own_cost,
                "cloud_cost_usd": own_cloud,
                "all_cloud_cost_usd": own_all_cloud,
                "budget_local_steps": own_moved,
                "turns_ending_local": own_again.local_endings,
                "resynthesis_cost_usd": own_again.cost_usd,
                "steps": rows,
            }
        )
    plans, plans_cloud = steps - continuation, cloud_steps - continuation_cloud
    (only,) = budgets if len(budgets) == 1 else (None,)
    return {
        "steps": steps,
        "cloud_steps": cloud_steps,
        "cloud_fraction": _fraction(cloud_steps, steps),
        "continuation_steps": continuation,
        "continuation_cloud_steps": continuation_cloud,
        "continuation_cloud_fraction": _fraction(continuation_cloud, continuation),
        "plan_steps": plans,
        "plan_cloud_steps": plans_cloud,
        "paced_steps": paced,
        "note": plan_note(steps, plans, plans_cloud),
        "switches": switches,
        "cost_usd": cost,
        "cloud_cost_usd": cloud_cost,
        "all_cloud_cost_usd": all_cloud,
        "cost_fraction": _ratio(cost, all_cloud),
        "budget": budget_dict(only) if only is not None else ("per_trajectory" if budgets else None),
        "budget_local_steps": moved,
        "budget_local_plan_steps": moved_plans,
        "resynthesis": resynthesis_summary(again, cloud_cost, all_cloud),
        "trajectories": trajectories,
    }
