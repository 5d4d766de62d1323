"""The cyclic garbage collector and the event loop.

A full (generation 2) collection walks every tracked object of the process while holding the
GIL: with torch and swarmtrain imported that is ~250k objects and 100-150 ms of CPU, during
which no thread runs, the trio or asyncio loop included. Those pauses are the largest
event-loop stalls a trainer sees (``benchmarks/benchmark_trio_lag.py --slow-steps``).
``freeze_startup_objects`` moves every object alive now into the collector's permanent
generation, so later full collections walk only what was created afterwards.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect garbage once, then exempt every surviving object from later collections;
    return how many objects were frozen.

    Call it once, after the long-lived objects exist (imports, the model, the optimizer, the
    swarm), before the training loop. Frozen objects are still freed by reference counting;
    only reference cycles among them that become garbage later are never collected, so
    freeze what lives for the whole process, not objects you will drop (``gc.unfreeze()``
    undoes it). The helper process of ``ProcessAverager`` freezes its own objects after
    startup.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
