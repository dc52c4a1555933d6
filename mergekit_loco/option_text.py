"""``--option KEY=VALUE`` as typed on a command line (merge and train read it alike); no torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def option_pairs(pairs: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """``(pair, key, text)`` of each ``KEY=VALUE``, the key with ``-`` as ``_``, both stripped.
    Raises ``ValueError`` naming the ``--option`` at fault: no ``=`` or no key, a key given
    twice (checked as the pairs are read, so a caller's own check of a pair comes first)."""
    seen = set()
    for pair in pairs:
        key, equals, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not equals or not key:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE, e.g. density=0.3")
        if key in seen:
            raise ValueError(f"--option {pair!r}: {key!r} is given twice")
        seen.add(key)
        yield pair, key, text.strip()
