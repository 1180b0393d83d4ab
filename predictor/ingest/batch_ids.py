"""X-Batch-Id memory: a retried or concurrently repeated batch is counted once.

A request claims its id before it reads the body; a second request with the same
id waits for the first one's outcome instead of racing it: counted → a duplicate,
refused (bad body, throttled, stopping) → it goes ahead itself, so a retry is never
answered "duplicate" for a batch that was not taken.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

SEEN_BATCH_IDS = 200_000             # far more than any retry window


class BatchIds:
    def __init__(self, capacity: int = SEEN_BATCH_IDS):
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._claimed: dict[str, asyncio.Future] = {}

    async def claim(self, batch_id: str) -> bool:
        """True: this request takes the batch and must `settle` it; False: it was already taken."""
        while True:
            if batch_id in self._seen:
                return False
            other = self._claimed.get(batch_id)
            if other is None:
                break
            await asyncio.shield(other)
        self._claimed[batch_id] = asyncio.get_running_loop().create_future()
        return True

    def settle(self, batch_id: str, taken: bool) -> None:
        """End a claim: `taken` remembers the id; otherwise a waiting repeat goes ahead."""
        if taken:
            self._seen[batch_id] = None
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
        claim = self._claimed.pop(batch_id, None)
        if claim is not None and not claim.done():
            claim.set_result(taken)
