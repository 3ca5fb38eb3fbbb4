"""An order-keeping map over worker processes, for tokenization in ``prepare-data --workers N``."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable, Iterator
from typing import Any, Callable

__all__ = ["ordered_map"]


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int, initializer: Callable[..., None],
                initargs: tuple[Any, ...]) -> Iterator[Any]:
    """``fn(item)`` for each item, in input order: in this process (``workers=1``) or in ``workers`` processes,
    each set up once with ``initializer(*initargs)`` (a tokenizer is loaded per process, never pickled).

    Results come back in input order whatever process computed them, so the output is the same for any
    ``workers``. At most ``4 * workers`` items are in flight: the input is streamed, never read whole.
    """
    if workers == 1:
        initializer(*initargs)
        yield from map(fn, items)
        return
    # fork: workers start at once, without importing again; the tokenizer is loaded after the fork, so its thread
    # pool is never inherited (tokenizers' fork warning does not apply).
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: list[Any] = []
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 4 * workers:
                yield pending.pop(0).get()
        for result in pending:
            yield result.get()
