"""Bits spent where they matter: each layer's K and V codec chosen under an average budget.

A sensitivity map (``minillama ppl --sensitivity --kv SPEC --json``, eval/sensitivity.py) says
what storing one tensor of one layer with the spec's codec costs, everything else exact: a mean
KL divergence from the exact model. Maps of specs that share everything but the codecs (k3v2lm:
lm3h keys, lm2h values; k4v3lmc: lm4h keys, lm3h values) give each tensor a few priced
choices. ``allocate`` picks one per tensor so that the average bits per element stay within a
budget and the summed cost is low:

* every tensor starts at its cheapest choice;
* while the budget allows, the upgrade that removes the most cost per added bit is taken (the
  greedy rule of bit allocation in transform coding); ties go to the lower tensor index, so
  the same maps always give the same spec.

The costs add only approximately (a whole scheme's KLD is a little above the sum of its
tensors'; docs/quality.md measures both), so a chosen mix is checked on the cached path like
any other spec, and on texts other than the one its maps were measured on.

``minillama kv allocate`` prints the result as a ``--kv ...,layers=K/V;...`` spec
(eval/allocation.py reads the maps). These are pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillama.errors import UserError
from minillama.kv.codecs import Codec


@dataclass(frozen=True)
class Choice:
    """One way to store one tensor (K or V) of one layer: its codec, bits per element, cost."""

    codec: Codec
    bits: float  # codes and scales per element, as stored (Codec.body_bits)
    cost: float  # what storing this tensor so loses (a sensitivity map's KLD)


def allocate(choices: list[list[Choice]], budget: float) -> list[int]:
    """For each tensor j, the index of its chosen entry in choices[j]: the greedy upgrades by cost
    removed per added bit while the average of the chosen bits stays <= budget."""
    if any(not c for c in choices):
        raise UserError("every tensor needs at least one priced codec to choose from")
    pick = [min(range(len(c)), key=lambda i, c=c: (c[i].bits, c[i].cost, i)) for c in choices]
    total = sum(c[i].bits for c, i in zip(choices, pick))
    limit = budget * len(choices) + 1e-9
    if total > limit:
        raise UserError(
            f"a budget of {budget:g} bits is below the cheapest choice ({total / len(choices):.3f} bits with every "
            "tensor at its fewest bits): raise it"
        )
    while True:
        best: tuple[float, int, int] | None = None  # (cost removed per bit, tensor, choice)
        for j, options in enumerate(choices):
            now = options[pick[j]]
            for i, c in enumerate(options):
                extra = c.bits - now.bits
                if extra <= 0 or c.cost >= now.cost or total + extra > limit:
                    continue
                gain = (now.cost - c.cost) / extra
                if best is None or gain > best[0]:
                    best = (gain, j, i)
        if best is None:
            return pick
        _, j, i = best
        total += choices[j][i].bits - choices[j][pick[j]].bits
        pick[j] = i
