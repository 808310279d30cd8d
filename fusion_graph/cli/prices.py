"""What the CLI says about prices: the cloud model's price now, and the settings that would give one.

``report`` compares a thread's cost with what the same tokens would cost on
cloud, over the inferences that have a price only: an inference whose price
was unknown when it ran is priced now from its recorded tokens when the cloud
model's price is known now (``repriced``); one still without a price is
counted apart (``unpriced``), never as free. ``doctor`` warns when the cloud
model has no price; both name only the settings that are not already set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusion_graph.cli.common import run_prices

if TYPE_CHECKING:
    from fusion_graph.context import FusionContext
    from fusion_graph.providers.pricing import TokenPrices
    from fusion_graph.routing.records import RouteRecord
    from fusion_graph.settings import FusionSettings


def cloud_prices(context: FusionContext, settings: FusionSettings) -> TokenPrices | None:
    """The run's cloud model's prices now (overrides, else the catalogue); ``None``: unknown."""
    return run_prices(context, settings).cloud


def price_source(settings: FusionSettings, model: str) -> str:
    """Where ``model``'s price is looked up, in words."""
    if model in settings.price_overrides or f"cloud:{model}" in settings.price_overrides:
        return "FUSION_PRICE_OVERRIDES"
    if settings.cloud_price_like:
        return f"genai-prices catalogue, as FUSION_CLOUD_PRICE_LIKE={settings.cloud_price_like}"
    if settings.cloud_base_url:
        return "genai-prices catalogue, provider guessed from FUSION_CLOUD_BASE_URL"
    return "genai-prices catalogue"


def price_fix(settings: FusionSettings, model: str) -> str:
    """How to give ``model`` a price, suggesting only settings that are not set already."""
    override = (
        f"set FUSION_PRICE_OVERRIDES='{{\"{model}\": [input, output, cached_input]}}' "
        "(USD per million tokens, by model name or provider id)"
    )
    if settings.cloud_price_like:
        return (
            f"{override}: FUSION_CLOUD_PRICE_LIKE={settings.cloud_price_like} is set, and that catalogue "
            f"provider has no {model!r}"
        )
    return f"{override}, or FUSION_CLOUD_PRICE_LIKE=openai for a gateway that bills like a catalogue provider"


@dataclass(frozen=True)
class PricedCosts:
    """A thread's cost and its all-cloud cost, over the same inferences: those with a price.

    Attributes:
        cost_usd: Their recorded costs, plus the costs of ``repriced`` ones.
        all_cloud_usd: The same inferences at the cloud model's prices (cloud ones at their
            own cost); ``None`` when the cloud model's price is unknown.
        priced: Inferences counted in both.
        repriced: Inferences with no cost when they ran, priced now from their tokens.
        unpriced: Inferences still without a price: left out of both.
        unpriced_providers: The providers that answered those.
        unanswered: Inferences no provider answered: nothing to price, no cost.
    """

    cost_usd: float = 0.0
    all_cloud_usd: float | None = None
    priced: int = 0
    repriced: int = 0
    unpriced: int = 0
    unpriced_providers: tuple[str, ...] = ()
    unanswered: int = 0

    @property
    def savings(self) -> tuple[float | None, float | None]:
        """``(all-cloud - cost, that as a share of all-cloud)``; ``None`` where unknown."""
        if self.all_cloud_usd is None:
            return None, None
        saved = self.all_cloud_usd - self.cost_usd
        return saved, (round(saved / self.all_cloud_usd, 4) if self.all_cloud_usd > 0 else None)


def priced_costs(records: Sequence[RouteRecord], cloud: TokenPrices | None, cloud_model: str) -> PricedCosts:
    """Cost and all-cloud cost of ``records`` over the inferences with a price, now or when they ran.

    A cloud inference of ``cloud_model`` that had no price when it ran is priced
    now from its recorded tokens when ``cloud`` is known; any other inference
    without a cost (or without token counts) is counted in ``unpriced`` only.
    """
    from fusion_graph.providers.pricing import answering_leg
    from fusion_graph.routing.records import in_all_cloud_baseline

    cost, all_cloud = 0.0, 0.0
    priced = repriced = unanswered = 0
    unpriced: list[str] = []
    for record in records:
        if record["provider"] is None:  # no provider answered: it cost nothing, there is no price to find
            unanswered += 1
            continue
        prompt, completion = record["prompt_tokens"], record["completion_tokens"]
        tokens = None if prompt is None or completion is None else (prompt, completion)
        cached = min(record["cached_tokens"] or 0, prompt or 0)
        leg, spent = answering_leg(record), record["cost_usd"]
        same_model = record["provider"] == f"cloud:{cloud_model}"
        if spent is None and leg == "cloud" and same_model and cloud is not None and tokens is not None:
            spent = cloud.cost(tokens[0], cached, tokens[1])
            repriced += 1
        if spent is None or (leg == "local" and tokens is None):
            unpriced.append(record["provider"])
            continue
        priced += 1
        cost += spent
        if not in_all_cloud_baseline(record):
            continue  # spent, but no all-cloud run would have made it: savings are net of it
        if cloud is not None and leg == "cloud":
            all_cloud += spent
        elif cloud is not None and tokens is not None:
            all_cloud += cloud.cost(tokens[0], cached, tokens[1])
    return PricedCosts(
        cost_usd=cost,
        all_cloud_usd=all_cloud if cloud is not None else None,
        priced=priced,
        repriced=repriced,
        unpriced=len(unpriced),
        unpriced_providers=tuple(sorted(set(unpriced))),
        unanswered=unanswered,
    )


def price_note(
    settings: FusionSettings, model: str, cloud: TokenPrices | None, costs: PricedCosts
) -> str | None:
    """What the cost columns left out or priced late, and how to price the rest; ``None``: nothing."""
    notes: list[str] = []
    if costs.repriced:
        notes.append(
            f"{costs.repriced} inference(s) of {model!r} had no price when they ran: priced now from "
            "their recorded tokens at its current price"
        )
    if cloud is None:
        notes.append(
            f"the cloud model {model!r} has no known price ({price_source(settings, model)}): all-cloud "
            f"and savings are unknown; {price_fix(settings, model)}"
        )
    elif costs.unpriced:
        notes.append(
            f"{costs.unpriced} inference(s) have no price (answered by "
            f"{', '.join(costs.unpriced_providers)}): "
            "cost, all-cloud and savings leave them out; price them with FUSION_PRICE_OVERRIDES "
            "(USD per million tokens, by model name or provider id)"
        )
    if costs.unanswered:
        notes.append(f"{costs.unanswered} inference(s) got no answer from any provider: they cost nothing")
    return "; ".join(notes) or None
