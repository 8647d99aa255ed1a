"""`--quantization auto`: the bit allocation, a pure function of measured (bytes, sensitivity).

Each linear has a few options (float, int8, int4 with some group sizes), each with its stored
bytes and a sensitivity: the KL divergence its rounding alone adds to the model's next-token
distributions (builder/quant/quant_auto_sensitivity.py). Assuming sensitivities add up, as ZeroQ (Cai
et al., "ZeroQ: A Novel Zero Shot Quantization Framework", 2020) and HAWQ-V3's integer program
(Yao et al., 2021) do, picking the fewest bytes under a total-sensitivity limit is a multiple-
choice knapsack. Its Lagrangian solutions (Shoham & Gersho, "Efficient bit allocation for an
arbitrary set of quantizers", 1988) lie on each linear's lower convex hull of (bytes,
sensitivity), and marginal analysis walks them in order: start every linear at its smallest
option, then repeatedly take the one upgrade (to the next hull point of one linear) that removes
the most sensitivity per extra byte. The result is a ladder of assignments, from the fewest bytes
to the most precise, each the best known trade-off at its size; the caller then measures real
perplexity along the ladder (quant_auto.py) instead of trusting the additive model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class Option:
    """One way to store one linear."""
    name: str           # candidate name, e.g. "int4-g32", "int8", "none"
    num_bytes: int      # bytes it stores (weights, scales, zeros)
    sensitivity: float  # measured KL it adds alone (>= 0; smaller is better)


def lower_hull(options: Sequence[Option]) -> List[Option]:
    """The options on the lower convex hull of (bytes, sensitivity), by increasing bytes.

    An option that another matches or beats at no more bytes is dropped, and so is one above the
    segment joining its neighbours (no Lagrange multiplier would ever pick it)."""
    if not options:
        raise ValueError("lower_hull: no options")
    # by bytes, ties broken by sensitivity; keep a strictly decreasing sensitivity staircase
    stair: List[Option] = []
    for o in sorted(options, key=lambda o: (o.num_bytes, o.sensitivity)):
        if stair and o.sensitivity >= stair[-1].sensitivity:
            continue
        stair.append(o)
    hull: List[Option] = []
    for o in stair:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above segment a -> o: drop it
            if (b.sensitivity - a.sensitivity) * (o.num_bytes - a.num_bytes) >= \
                    (o.sensitivity - a.sensitivity) * (b.num_bytes - a.num_bytes):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


def allocation_ladder(options: Dict[str, Sequence[Option]]) -> List[Dict[str, Option]]:
    """Assignments {linear: Option} from the fewest bytes to the most precise (marginal analysis
    over each linear's lower hull). Step 0 takes every linear's smallest option; each next step
    upgrades one linear by one hull point, the one with the largest sensitivity drop per byte.
    The last step takes every linear's least sensitive option."""
    hulls = {name: lower_hull(opts) for name, opts in options.items()}
    level = {name: 0 for name in hulls}
    ladder = [{name: h[0] for name, h in hulls.items()}]

    def gain(name: str) -> float:
        h, i = hulls[name], level[name]
        a, b = h[i], h[i + 1]
        return (a.sensitivity - b.sensitivity) / max(1, b.num_bytes - a.num_bytes)

    while True:
        upgradable = [n for n in hulls if level[n] + 1 < len(hulls[n])]
        if not upgradable:
            return ladder
        best = max(upgradable, key=lambda n: (gain(n), n))
        level[best] += 1
        step = dict(ladder[-1])
        step[best] = hulls[best][level[best]]
        ladder.append(step)


def total_bytes(assignment: Dict[str, Option]) -> int:
    return sum(o.num_bytes for o in assignment.values())


def total_sensitivity(assignment: Dict[str, Option]) -> float:
    return sum(o.sensitivity for o in assignment.values())
