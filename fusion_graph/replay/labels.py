"""Offline labels: would the local model have taken the recorded action at each step?

``fusion-graph label`` asks the operator's local model every step (assistant
message) of a strong model's recorded trajectories, with the prompt and tools
that step had, and writes one JSONL line per step (``label_line``): where the
step is (trace, line, trajectory, position, turn, step), its score under the routing
rule with the signals it was scored from, the recorded action, the local
model's action and whether they are the same (``routing.records.same_action``; ``null``
with the error when the local model gave no answer). ``fusion-graph calibrate
--labels`` reads them back (``read_labels``) to send the disagreeing steps to
cloud. A thread store's shadow checks are the same kind of label on real
traffic (``shadow_labels``): a local step where the cloud, asked beside it,
acted otherwise was likely wrong.

Everything here is pure (no model call): the asking is ``labelling``'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import BaseTool, StructuredTool, ToolException

from fusion_graph.context import FusionContext
from fusion_graph.errors import TraceError
from fusion_graph.replay.history import route_history, split_system
from fusion_graph.replay.traces import RecordedTrajectory
from fusion_graph.routing.records import RouteRecord, action, upgraded
from fusion_graph.routing.score import StepScore, StepSignals, TroubleSignals, score_step
from fusion_graph.sizing.turn import build_prompt

ToolSource = Literal["recorded", "inferred"]
"""Which tools a step is asked with: the record's own schemas, or those, else ones inferred from its calls."""
TOOL_SOURCES: tuple[ToolSource, ...] = ("recorded", "inferred")

#: The fields of a step's signals without the trouble signals (``score.StepSignals``).
SEED_FIELDS = tuple(field.name for field in dataclasses.fields(StepSignals))

LabelKey = tuple[str, int, int]
"""Where a step is: its trace file's stem, its record's line there, the assistant message's position.

The line, not the record's ``id``: ids repeat in some trace files, lines do not."""


@dataclass(frozen=True)
class StepToLabel:
    """One recorded step, ready to be asked of the local model.

    Attributes:
        key: Trace, line and position (``LabelKey``).
        trajectory: The trajectory's id.
        turn: Index of the turn in the trajectory.
        step: Index of the step in its turn (0: the plan).
        prompt: What the step sends: the trace's system prompt, then the history before it.
        recorded: The recorded answer (a strong model's).
        signals: The step's routing signals, the trouble signals included (``TroubleSignals``).
        score: Its score under the routing rule of the context it was scored with.
        tools: The tools it is asked with (never run: their schemas only).
    """

    key: LabelKey
    trajectory: str
    turn: int
    step: int
    prompt: tuple[BaseMessage, ...]
    recorded: AIMessage
    signals: StepSignals
    score: StepScore
    tools: tuple[BaseTool, ...] = ()


def _recorded_only(**_: Any) -> str:
    """A recorded trace's tool has a schema and no body: labelling asks for answers, it never runs calls."""
    raise ToolException("this tool comes from a recorded trace: only its schema is known, so it cannot run")


def schema_tools(schemas: Iterable[Mapping[str, Any]]) -> tuple[BaseTool, ...]:
    """Tools with the given OpenAI schemas, bound to the model like the graph's tools; never run."""
    tools = []
    for schema in schemas:
        function = schema.get("function", schema)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        tools.append(
            StructuredTool(
                name=function["name"],
                description=function.get("description") or "",
                args_schema=dict(parameters),
                func=_recorded_only,
            )
        )
    return tuple(tools)


def _json_type(value: Any) -> str | None:
    for kind, types in (
        ("boolean", bool),
        ("integer", int),
        ("number", float),
        ("string", str),
        ("array", list),
        ("object", dict),
    ):
        if isinstance(value, types):
            return kind
    return None


def inferred_tools(messages: Sequence[BaseMessage]) -> tuple[dict[str, Any], ...]:
    """OpenAI schemas for the tools a conversation calls: each name with the argument names and types seen.

    For traces that record no schemas: every tool the trajectory calls, with every
    argument it was given as an optional property typed as its JSON values are
    (a property given values of several types has no type).
    """
    found: dict[str, dict[str, set[str | None]]] = {}
    for message in messages:
        if not isinstance(message, AIMessage):
            continue
        for call in message.tool_calls:
            properties = found.setdefault(call["name"], {})
            for name, value in (call["args"] or {}).items():
                properties.setdefault(name, set()).add(_json_type(value))
    schemas = []
    for name, properties in found.items():
        shaped = {
            arg: ({"type": next(iter(kinds))} if len(kinds) == 1 and None not in kinds else {})
            for arg, kinds in properties.items()
        }
        schemas.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": "",
                    "parameters": {"type": "object", "properties": shaped},
                },
            }
        )
    return tuple(schemas)


def trajectory_tools(trajectory: RecordedTrajectory, source: ToolSource = "recorded") -> tuple[BaseTool, ...]:
    """The tools a trajectory's steps are asked with: the record's, else (``inferred``) its calls' shapes."""
    schemas = trajectory.tools
    if not schemas and source == "inferred":
        schemas = inferred_tools(trajectory.messages)
    return schema_tools(schemas)


def seed_signals(signals: StepSignals) -> StepSignals:
    """The seed's four-term signals of a step (the trouble signals dropped)."""
    return StepSignals(**{name: getattr(signals, name) for name in SEED_FIELDS})


def rule_score(signals: StepSignals, context: FusionContext) -> StepScore:
    """A step's score under ``context``'s rule: with its trouble terms (and weights) only when they are on."""
    if context.trouble_signals and isinstance(signals, TroubleSignals):
        return score_step(signals, context.trouble_weights)
    return score_step(seed_signals(signals))


def steps_to_label(
    trajectory: RecordedTrajectory,
    context: FusionContext,
    *,
    tools: Sequence[BaseTool] = (),
    local_window: int | None = None,
) -> list[StepToLabel]:
    """Every step of ``trajectory`` with the prompt it sent and its signals, as the graph would measure them.

    The signals come from ``route_history`` (the graph's own measurement, ``tools``
    counted in the prompt estimate, ``local_window`` the local server's per-slot
    window), always with the trouble signals so calibration can weigh them or
    not; ``score`` follows ``context`` (``rule_score``). The prompt is the
    trace's system prompt (else ``context.system_prompt``, as replay does) and
    the messages before the step.
    """
    measured = dataclasses.replace(context, trouble_signals=True)
    routed = route_history(trajectory.messages, measured, tools=tools, local_window=local_window)
    system, body = split_system(trajectory.messages)
    offset = len(trajectory.messages) - len(body)
    system_prompt = system or context.system_prompt
    found = []
    turn = -1
    for item in routed:
        turn += item.step == 0
        recorded = trajectory.messages[item.position]
        assert isinstance(recorded, AIMessage)  # route_history routes assistant messages only
        found.append(
            StepToLabel(
                key=(trajectory.file, trajectory.line, item.position),
                trajectory=trajectory.id,
                turn=max(turn, 0),
                step=item.step,
                prompt=tuple(build_prompt(system_prompt, body[: item.position - offset])),
                recorded=recorded,
                signals=item.signals,
                score=rule_score(item.signals, context),
                tools=tuple(tools),
            )
        )
    return found


def label_line(
    step: StepToLabel,
    answer: AIMessage | None,
    *,
    agrees: bool | None,
    error: str | None = None,
    provider: str | None = None,
    completion_tokens: int | None = None,
    latency_s: float | None = None,
) -> dict[str, Any]:
    """The JSONL line of a labelled step (``agrees``: ``None`` when the local model gave no answer)."""
    trace, line, position = step.key
    return {
        "trace": trace,
        "line": line,
        "trajectory": step.trajectory,
        "position": position,
        "turn": step.turn,
        "step": step.step,
        "score": step.score.score,
        "points": step.score.points,
        "breakdown": step.score.breakdown(),
        "signals": dict(vars(step.signals)),
        "agrees": agrees,
        "recorded_action": action(step.recorded),
        "local_action": action(answer) if answer is not None else None,
        "error": error,
        "provider": provider,
        "completion_tokens": completion_tokens,
        "latency_s": latency_s,
    }


@dataclass(frozen=True)
class Label:
    """One labelled step as calibration reads it: where it is, its signals, whether the local model agreed."""

    trace: str
    line: int
    """The trajectory's line in its trace file (its thread's place in a store)."""
    trajectory: str
    position: int
    turn: int
    step: int
    signals: StepSignals
    """``TroubleSignals`` when the trouble signals were measured, else the seed's four."""
    agrees: bool | None
    """``None``: not labelled (no local answer, or a step with no shadow check)."""

    @property
    def key(self) -> LabelKey:
        """Trace, line and position."""
        return (self.trace, self.line, self.position)


def signals_from(data: Mapping[str, Any]) -> StepSignals:
    """Step signals from a record's or a label's ``signals`` (with the trouble signals when it has them).

    Raises:
        KeyError, TypeError: ``data`` is not a signals object.
    """
    if "error_severity" in data:
        names = {field.name for field in dataclasses.fields(TroubleSignals)}
        return TroubleSignals(**{name: data[name] for name in names})
    return StepSignals(**{name: data[name] for name in SEED_FIELDS})


def parse_label(data: Any) -> Label:
    """A label from one parsed JSONL line.

    Raises:
        ValueError: The line is not a label.
    """
    try:
        agrees = data["agrees"]
        if agrees is not None and not isinstance(agrees, bool):
            raise TraceError(f"'agrees' must be true, false or null, got {agrees!r}")
        return Label(
            trace=str(data["trace"]),
            line=int(data["line"]),
            trajectory=str(data["trajectory"]),
            position=int(data["position"]),
            turn=int(data["turn"]),
            step=int(data["step"]),
            signals=signals_from(data["signals"]),
            agrees=agrees,
        )
    except (KeyError, TypeError) as error:
        raise TraceError(f"not a label line ({type(error).__name__}: {error})") from error


def read_label_lines(path: Path) -> list[dict[str, Any]]:
    """The parsed lines of a labels file, the last line of each step kept (a retried step's).

    A last line cut short (a run killed while writing it) is left out.

    Raises:
        TraceError: A line that is not a label, naming the file and line.
    """
    return [data for data, _ in _parsed_lines(path)]


def _parsed_lines(path: Path) -> list[tuple[dict[str, Any], Label]]:
    """Each kept line of a labels file with its label (``read_label_lines``): parsed once for both."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    kept: dict[LabelKey, tuple[dict[str, Any], Label]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            label = parse_label(data)
        except ValueError as error:  # json.JSONDecodeError is one
            if number == len(lines):  # no newline after it: cut short while being written
                continue
            raise TraceError(f"{path}:{number}: {error}") from error
        kept[label.key] = (data, label)
    return list(kept.values())


def read_labels(path: Path) -> list[Label]:
    """The labels of a ``fusion-graph label`` output file (the last line of each step; ``read_label_lines``).

    Raises:
        TraceError: The file is missing, or a line is not a label.
    """
    if not path.is_file():
        raise TraceError(f"no labels file at {path}: `fusion-graph label TRACES --out {path}` writes one")
    return [label for _, label in _parsed_lines(path)]


def shadow_labels(route_logs: Mapping[str, Sequence[RouteRecord]], *, trace: str = "threads") -> list[Label]:
    """Labels from a thread store: each thread's plans and steps, labelled where a shadow check ran.

    A shadow check (``kind="shadow"``, its ``shadow``) asked the cloud beside a
    local step: ``agrees`` false means the cloud acted otherwise, so the local step
    was likely wrong. Every plan and step of a thread is kept in order (the dial
    routes them all), unlabelled where no check ran; repairs and side inferences
    are not routed by the score and are left out.
    """
    found = []
    for line, (thread, records) in enumerate(route_logs.items(), start=1):
        checks: dict[tuple[int, int], bool | None] = {}
        for record in records:
            shadow = upgraded(record).get("shadow") if record["kind"] == "shadow" else None
            if shadow:
                checks[(record["turn"], int(shadow.get("of_step", record["step"])))] = shadow.get("agrees")
        position = 0
        for record in records:
            if record["kind"] not in ("plan", "step") or not record.get("signals"):
                continue
            found.append(
                Label(
                    trace=trace,
                    line=line,
                    trajectory=thread,
                    position=position,
                    turn=record["turn"],
                    step=record["step"],
                    signals=signals_from(record["signals"]),
                    agrees=checks.get((record["turn"], record["step"])),
                )
            )
            position += 1
    return found


def label_trajectories(labels: Iterable[Label]) -> list[list[Label]]:
    """Labels grouped by trajectory (first seen first), each in the order of its steps."""
    grouped: dict[tuple[str, int], list[Label]] = {}
    for label in labels:
        grouped.setdefault((label.trace, label.line), []).append(label)
    return [sorted(steps, key=lambda label: label.position) for steps in grouped.values()]
