"""Statistics over seeds (or fine-tune sets): spread, paired differences, t-intervals, orderings.

Two runs that share a seed share their initial weights, data order and validation documents,
so their losses are compared **paired**: ``d_s = a_s - b_s`` over the seeds both ran. The
interval of ``mean(d)`` is Student's t: ``mean(d) ± t_{(1+c)/2, n-1} * sd(d) / sqrt(n)``. An
ordering is stated only where that interval excludes 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: confidence of every interval in the reports.
CONFIDENCE = 0.95

#: differences whose sd is at most this times ``max(1, |mean|)`` are one number repeated, up to
#: float rounding (``a = b + 0.1`` seed by seed gives an sd of about 1e-16, not 0)
CONSTANT_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Spread:
    """``n`` values: mean, sample standard deviation (ddof 1; nan for n = 1), min and max."""

    mean: float
    std: float
    low: float
    high: float
    n: int


def spread(values: Iterable[float]) -> Spread:
    """``mean = sum(x) / n``; ``std = sqrt(sum((x - mean)^2) / (n - 1))`` of any iterable of
    numbers (a numpy array's too)."""
    values = [float(value) for value in values]
    if not values:
        raise ValueError("spread of no values")
    n = len(values)
    if math.inf in values and -math.inf in values:  # a failed run on each side: no mean
        mean = math.nan
    else:
        try:
            mean = math.fsum(values) / n
        except OverflowError:  # values near the float maximum (a damaged file): the same, scaled
            mean = math.fsum(v / n for v in values)
    if n < 2 or not all(math.isfinite(v) for v in values):
        std = math.nan
    else:
        deviations = [v - mean for v in values]
        try:
            std = math.sqrt(math.fsum(d**2 for d in deviations) / (n - 1))
        except OverflowError:  # squares beyond the float range: the same sum, scaled
            scale = max(abs(d) for d in deviations)
            std = scale * math.sqrt(math.fsum((d / scale) ** 2 for d in deviations) / (n - 1))
    return Spread(mean=mean, std=std, low=min(values), high=max(values), n=n)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, bool | None]:
    """``(delta, significant)`` by the rule of the first published tables: ``delta = mean(d)``,
    significant when ``|delta| > std(d)`` (ddof 1). None (cannot tell) with fewer than two
    shared seeds or a failed run. Weak (about p = 0.4 with two seeds): new reports use
    :func:`paired_interval`."""
    interval = paired_interval(a, b)
    if interval.separated is None:
        return interval.mean, None
    return interval.mean, abs(interval.mean) > interval.std


@dataclass(frozen=True)
class PairedInterval:
    """``d_s = a_s - b_s`` over ``n`` shared seeds: mean, sd (ddof 1) and the ``confidence``
    t-interval ``[low, high]`` of the mean (nan where it cannot be formed)."""

    mean: float
    std: float
    low: float
    high: float
    n: int
    confidence: float

    @property
    def constant(self) -> bool:
        """Every seed differs by the same amount (:data:`CONSTANT_TOLERANCE`): a zero-width
        interval, no evidence, but a sign that the two are one run or share their randomness."""
        if self.n < 2 or not math.isfinite(self.std):
            return False
        return self.std <= CONSTANT_TOLERANCE * max(1.0, abs(self.mean))

    @property
    def separated(self) -> bool | None:
        """True when the interval excludes 0 (a real difference), False when it holds 0, None
        when there is no interval (fewer than two seeds, a failed run) or it has no width
        (:attr:`constant`)."""
        if self.n < 2 or not (math.isfinite(self.low) and math.isfinite(self.high)):
            return None
        if self.constant:
            return None
        return self.low > 0 or self.high < 0

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def paired_interval(
    a: Mapping[int, float], b: Mapping[int, float], confidence: float = CONFIDENCE
) -> PairedInterval:
    """The t-interval of ``mean_s(a_s - b_s)`` over the seeds both ran, at ``confidence``, a
    probability in (0, 1) (0.95, not 95)."""
    from scipy.stats import t as student_t

    check_confidence(confidence)
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return PairedInterval(math.nan, math.nan, math.nan, math.nan, 0, confidence)
    differences = spread([a[seed] - b[seed] for seed in seeds])
    if differences.n < 2 or not math.isfinite(differences.std):
        return PairedInterval(differences.mean, math.nan, math.nan, math.nan, differences.n,
                              confidence)  # fmt: skip
    quantile = float(student_t.ppf((1 + confidence) / 2, differences.n - 1))
    half = quantile * differences.std / math.sqrt(differences.n)
    return PairedInterval(differences.mean, differences.std, differences.mean - half,
                          differences.mean + half, differences.n, confidence)  # fmt: skip


def check_confidence(confidence: float) -> None:
    """ValueError unless ``confidence`` is a real number in (0, 1)."""
    real = isinstance(confidence, numbers.Real) and not isinstance(confidence, bool)
    if not (real and 0 < confidence < 1):
        raise ValueError(f"confidence must lie in (0, 1) (0.95 for 95%), got {confidence!r}")


def ordering(losses: Mapping[str, Mapping[int, float]], confidence: float = CONFIDENCE) -> str:
    """Names sorted by their mean loss over the seeds all of them ran, joined by ``<`` at a cut
    where every name before it is separated from every name after it (each pair's paired
    interval of ``before - after`` lies below 0) and by ``~`` elsewhere (cannot tell), e.g.
    ``a < b ~ c``: so every ``<`` may be read transitively, and ``a ~ b < c`` never states
    ``a < c`` unless that pair separates. Seeds some names lack are left out of the ranking and
    the intervals alike (so a name cannot rank on one set of seeds and be compared on another),
    and the text says which seeds it used: ``a < b (seeds 0, 1: the ones all ran)``."""
    check_confidence(confidence)
    if not losses:
        return ""
    every = set.union(*(set(by_seed) for by_seed in losses.values()))
    seeds = set.intersection(*(set(by_seed) for by_seed in losses.values()))
    shared = {name: {s: by_seed[s] for s in seeds} for name, by_seed in losses.items()}
    means = {name: spread(list(by_seed.values())).mean if seeds else math.nan
             for name, by_seed in shared.items()}  # fmt: skip
    names = sorted(means, key=lambda name: (math.isnan(means[name]), means[name], name))

    def below(lower: str, upper: str) -> bool:
        interval = paired_interval(shared[lower], shared[upper], confidence)
        return bool(interval.separated) and interval.high < 0

    text = names[0]
    for cut in range(1, len(names)):
        separated = all(below(a, b) for a in names[:cut] for b in names[cut:])
        text += (" < " if separated else " ~ ") + names[cut]
    if seeds != every:
        used = ", ".join(map(str, sorted(seeds))) or "none"
        text += f" (seeds {used}: the ones all ran)"
    return text


def format_interval(interval: PairedInterval, digits: int = 4) -> str:
    """``-0.0400 [-0.0520, -0.0280]`` (separated), ``+0.0012 [-0.0100, +0.0124] n.s.``,
    ``+0.0012 ?`` (one seed: no interval), or ``-0.5000 (same on every seed)``."""
    if math.isnan(interval.mean):
        return "-"
    text = f"{interval.mean:+.{digits}f}"
    if interval.constant:
        return text + " (same on every seed)"
    if interval.separated is None:
        return text + " ?"
    text += f" [{interval.low:+.{digits}f}, {interval.high:+.{digits}f}]"
    return text if interval.separated else text + " n.s."
