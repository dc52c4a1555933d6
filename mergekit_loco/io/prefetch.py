"""Read the next item while the caller works on the current one, within a byte budget.

One background thread runs ``read(key)`` for the key after the current one. Reading (``readinto``)
and torch kernels release the GIL, so the read of tensor i+1 overlaps the math on tensor i. The
overlap is only started when ``working_bytes(current) + input_bytes(next) <= budget``: a caller
that passes its no-prefetch peak as the budget keeps that peak (big neighbours are read in turn).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Key = TypeVar("Key")
Item = TypeVar("Item")


class Prefetcher(Generic[Key, Item]):
    """``for key, item in Prefetcher(keys, read, ...)``: ``item = read(key)``, read ahead by one.

    ``input_bytes(key)`` is what reading ``key`` holds, ``working_bytes(key)`` what working on
    it holds (its inputs included); the next key is read during the current one only if the two
    fit in ``budget_bytes``, else after the caller is done with the current item. An exception
    in ``read`` is raised from the iteration at that key.
    """

    def __init__(
        self,
        keys: Sequence[Key],
        read: Callable[[Key], Item],
        input_bytes: Callable[[Key], int],
        working_bytes: Callable[[Key], int],
        budget_bytes: int,
    ):
        self.keys = list(keys)
        self.read = read
        self.input_bytes = input_bytes
        self.working_bytes = working_bytes
        self.budget_bytes = budget_bytes

    def __iter__(self) -> Iterator[tuple[Key, Item]]:
        if not self.keys:
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mloco-prefetch") as pool:
            pending: Future[Item] = pool.submit(self.read, self.keys[0])
            for index, key in enumerate(self.keys):
                item = pending.result()
                following = self.keys[index + 1] if index + 1 < len(self.keys) else None
                overlap = following is not None and (
                    self.working_bytes(key) + self.input_bytes(following) <= self.budget_bytes
                )
                if overlap:
                    pending = pool.submit(self.read, following)
                yield key, item
                del item
                if following is not None and not overlap:
                    pending = pool.submit(self.read, following)
