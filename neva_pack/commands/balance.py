"""Balance reports: the order --balance_data_parallel writes, and the straggler overheads of the orders
a run or ``neva-pack stats --data_parallel`` compares (``packing.step_cost`` models the step time)."""

from __future__ import annotations

import numpy as np

from neva_pack.commands.report import BalanceReport
from neva_pack.packing import (
    AUTO, WORTH_IT, PackCosts, balance_order, modelled_costs, step_cost_model, step_overheads, straggler_overhead
)

__all__ = ["BALANCE_STREAM", "balance_report", "step_balance", "step_line"]

BALANCE_STREAM = 1
"""Second number of the balance generator's seed, (seed, 1): independent of the packer's stream."""


def balance_report(
    costs: PackCosts, data_parallel: int, setting: str, model, seed: int
) -> tuple[np.ndarray, BalanceReport]:
    """The order of --balance_data_parallel N and its report: by ``model``'s modelled step time
    (``costs`` from ``packing.modelled_costs``; the report then holds the modelled overheads of a
    random order, the attention order and this one), or with ``model`` None by attention + vision
    cost, unweighted. ``setting``: --step_cost_model as given; "before" is the order ``costs`` are in."""
    steps = {}
    if model is None:
        order = balance_order(costs, data_parallel, np.random.default_rng((seed, BALANCE_STREAM)))
    else:
        overheads, order = step_overheads(costs, data_parallel, seed)
        steps = {"step_model": model.name, "step_overhead_random": overheads.random,
                 "step_overhead_today": overheads.today, "step_overhead_after": overheads.modelled}  # fmt: skip
    figures = {
        f"{name}_overhead_{when}": straggler_overhead(getattr(costs, name), data_parallel, arrangement)
        for name in ("attention", "tokens", "images", "vision")
        for when, arrangement in (("before", None), ("after", order))
    }
    return order, BalanceReport(data_parallel=data_parallel, step_cost_model=setting, **figures, **steps)


def step_balance(arrays, data_parallel: int, setting: str = AUTO, seed: int = 0) -> BalanceReport:
    """``neva-pack stats --data_parallel N``: what balancing an output's packs (``stats.PackingArrays``)
    over N ranks would give (``balance_report``; "before" is the order the output is in)."""
    if int(data_parallel) != data_parallel or data_parallel < 1:
        raise ValueError(f"--data_parallel {data_parallel!r}: must be a positive integer")
    model = step_cost_model(setting, arrays.encoder, arrays.family)
    num_images = np.zeros(len(arrays.lengths), np.int64) if arrays.num_images is None else arrays.num_images
    if model is None:
        costs = PackCosts.of(arrays.lengths, arrays.offsets, num_images, arrays.vision_cost)
    else:
        costs = modelled_costs(model, arrays.lengths, arrays.offsets, num_images, arrays.image_tokens, arrays.vision_cost)
    return balance_report(costs, int(data_parallel), setting, model, seed)[1]


def step_line(balance: BalanceReport) -> str:
    """The modelled step time's straggler overhead of three orders, and whether balancing is worth it."""
    random, today, after = balance.step_overhead_random, balance.step_overhead_today, balance.step_overhead_after
    saving = random - after
    verdict = (f"worth it: balancing saves {100 * saving:.2f}% of the step time over a random order"
               if saving >= WORTH_IT else
               f"not worth it: a random order wastes {100 * random:.2f}% of the step time (under {100 * WORTH_IT:g}% to gain)")  # fmt: skip
    return (
        f"step time      N = {balance.data_parallel}, model {balance.step_model}: straggler overhead random {100 * random:.2f}%"
        f", attention order {100 * today:.2f}%, modelled order {100 * after:.2f}%; {verdict}"
    )
