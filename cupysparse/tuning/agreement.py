"""How the ranks of a distributed job come to make the same algorithm choices.

Each rank tunes on its own GPU and the tuner runs no collective: ranks meet different problems (their
sizes come from each rank's own data), so a collective per problem could wait forever for a rank
that never meets it. Instead, at a point every rank reaches in the same order (after a warm-up
step), a framework's collective gathers every rank's `local_entries()`, and `adopt` makes each rank
hold, for every (namespace, key) that any rank reported, the entry of the lowest rank that had one.
The default tuner then forgets what it remembered, so every rank chooses the same for every problem
that any of them had met. A problem first met later is tuned by each rank alone until the next
exchange. `cupysparse.adapters.torch.share_tuning` is the exchange over `torch.distributed`.

Entries travel as plain Python values: (namespace, key pairs, results, kernel sources).
"""

from __future__ import annotations

from collections.abc import Sequence

from cupysparse.tuning.shipped import tuning_cache
from cupysparse.tuning.tuner import default_tuner


def local_entries() -> list[tuple]:
    """The entries (the user's, else shipped) of every (namespace, key) the default tuner looked up
    in this process, in the order it first asked."""
    cache = tuning_cache()
    found = []
    for namespace, key in cache.asked():
        entry = cache.get(namespace, key)
        if entry is not None:
            found.append((namespace, key, entry.results, entry.kernel_sources))
    return found


def adopt(entries_by_rank: Sequence[Sequence[tuple]]) -> int:
    """Hold, for each (namespace, key) in `entries_by_rank` (every rank's `local_entries()`, in rank
    order), the entry of the lowest rank that has it: stored in the user's cache where this process's
    differs. Returns how many were stored; when any was, the default tuner forgets its choices."""
    winners: dict[tuple, tuple] = {}
    for entries in entries_by_rank:
        for namespace, key, results, kernel_sources in entries:
            winners.setdefault((namespace, tuple(sorted(key))), (namespace, key, results, kernel_sources))
    cache = tuning_cache()
    stored = 0
    for namespace, key, results, kernel_sources in winners.values():
        mine = cache.get(namespace, key)
        if mine is not None and (mine.results, mine.kernel_sources) == (tuple(results), tuple(kernel_sources)):
            continue
        cache.put(namespace, key, results, kernel_sources)
        stored += 1
    if stored:
        default_tuner().forget_choices()
    return stored
