"""The spectral figures docs/methods.md quotes, measured: Newton-Schulz gains, the fast path's
size against exact Iso-C, Iso-CTS with Newton-Schulz, and how far rank-deficient tasks move
each method's result (its dependence on LAPACK's arbitrary null-space vectors).

    python benchmarks/spectral_figures.py

Everything is float64 and seeded (seconds on one core); the numbers are properties of the
math, not of the machine.
"""

from __future__ import annotations

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from mergekit_loco.linalg import NS_COEFFICIENTS, NS_STEPS
from mergekit_loco.methods import get_method


def ns_gain(x: np.ndarray) -> np.ndarray:
    """Where Newton-Schulz sends a singular value ``x`` of ``M / ||M||_F``: ``p^5(x)``."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        x = a * x + b * x**3 + c * x**5
    return x


def gain_table() -> Table:
    table = Table(title="Newton-Schulz gain p^5(x) for singular values x of M / ||M||_F")
    table.add_column("case", justify="left")
    table.add_column("gain", justify="right")
    grid = np.linspace(0.0015, 1.0, 2_000_001)
    gains = ns_gain(grid)
    table.add_row("x in [0.0015, 1]: min, max", f"{gains.min():.3f}, {gains.max():.3f}")
    for d in (64, 1024, 8192):
        table.add_row(f"flat spectrum, d = {d} (x = 1/sqrt(d))", f"{ns_gain(d**-0.5):.3f}")
    return table


def relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``(||a|| / ||b||, cosine(a, b))``."""
    ratio = float(a.norm() / b.norm())
    cosine = float((a * b).sum() / (a.norm() * b.norm()))
    return ratio, cosine


def fast_path_table(generator: torch.Generator) -> Table:
    table = Table(title="||ns|| / ||exact|| (cosine): one matrix, or 3 Gaussian tasks for iso-cts")
    for column in ("method", "case", "ratio", "cosine", "ns singular values"):
        table.add_column(column, justify="left" if column in ("method", "case") else "right")
    flat = random_rotation(generator, 64)
    matrices = {
        "flat 64 x 64": flat,
        "1 x 64 row": torch.randn(1, 64, generator=generator, dtype=torch.float64),
        "Gaussian 64 x 32": torch.randn(64, 32, generator=generator, dtype=torch.float64),
        "Gaussian 32 x 8": torch.randn(32, 8, generator=generator, dtype=torch.float64),
        "Gaussian 256 x 256": torch.randn(256, 256, generator=generator, dtype=torch.float64),
    }
    for name, method in (("iso-c", "iso-c"), ("iso-cts", "iso-cts")):
        cases = matrices if method == "iso-c" else {
            f"{m} x {n}": [torch.randn(m, n, generator=generator, dtype=torch.float64)
                           for _ in range(3)]
            for m, n in ((64, 64), (40, 16), (256, 256))
        }  # fmt: skip
        for case, value in cases.items():
            deltas = [value] if method == "iso-c" else value
            exact = get_method(method).merge_tensor("w", deltas)
            fast = get_method(method, spectral="ns").merge_tensor("w", deltas)
            ratio, cosine = relative(fast, exact)
            spectrum, flat = torch.linalg.svdvals(fast), torch.linalg.svdvals(exact)[0]
            spread = f"{spectrum.min():.3g} to {spectrum.max():.3g} (exact {flat:.3g})"
            table.add_row(name, case, f"{ratio:.2f}", f"{cosine:.3f}", spread)
    return table


def low_rank(generator: torch.Generator, shape=(16, 16), rank=2) -> torch.Tensor:
    left = torch.randn(shape[0], rank, generator=generator, dtype=torch.float64)
    return left @ torch.randn(rank, shape[1], generator=generator, dtype=torch.float64)


def random_rotation(generator: torch.Generator, size: int = 16) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))[0]


def uniqueness_table(generator: torch.Generator, trials: int = 20) -> Table:
    """``||merge(P a Q, P b Q) - P merge(a, b) Q|| / ||merge(a, b)||`` for rank-2 16 x 16 tasks
    ``a, b``: P, Q random permutations (0 for every method determined by its inputs) or random
    rotations (0 for a spectral method determined by its inputs; entrywise methods such as TIES
    are not rotation-equivariant)."""
    title = f"Rank-2 16 x 16 tasks, permuted or rotated: how far the result moves ({trials} draws)"
    table = Table(title=title)
    for column in ("method", "permuted: median", "max", "rotated: median", "max"):
        table.add_column(column, justify="left" if column == "method" else "right")
    methods = [("tsv", {}), ("tsv", {"rank_aware": True}), ("iso-cts", {}),
               ("iso-cts", {"rank_aware": True}), ("iso-c", {}), ("iso-c", {"rank_aware": True}),
               ("ties", {})]  # fmt: skip
    identity = torch.eye(16, dtype=torch.float64)
    draws = {"permuted": [], "rotated": []}
    for _ in range(trials):
        a, b = low_rank(generator), low_rank(generator)
        for kind in draws:
            if kind == "permuted":
                p, q = (identity[torch.randperm(16, generator=generator)] for _ in range(2))
            else:
                p, q = (random_rotation(generator) for _ in range(2))
            draws[kind].append((a, b, p, q))
    for name, options in methods:
        method = get_method(name, **options)
        cells = []
        for cases in draws.values():
            moved = []
            for a, b, p, q in cases:
                merged = method.merge_tensor("w", [a, b])
                moved_result = method.merge_tensor("w", [p @ a @ q, p @ b @ q])
                moved.append(float((moved_result - p @ merged @ q).norm() / merged.norm()))
            cells += [f"{np.median(moved):.1%}", f"{max(moved):.1%}"]
        table.add_row(name + "".join(f" {k}={v}" for k, v in options.items()), *cells)
    return table


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    console = Console(width=160)
    for table in (gain_table(), fast_path_table(generator), uniqueness_table(generator)):
        console.print(table)


if __name__ == "__main__":
    main()
