"""``ProcessGradientAverager``: a ``GradientAverager`` whose swarm runs in a helper process.

The accumulators, the trigger and the weights stay in the trainer's process; the gradient
all-reduce (host, DHT, averager) runs in a helper process with the averaged buffers in shared
memory (see ``swarmtrain.averaging.process_averager``). For an ``Optimizer``::

    opt = swarmtrain.Optimizer(..., grad_averager_factory=ProcessGradientAverager)

Use it when the trainer's main thread is busy in Python: the gradient rounds then no longer
wait for the GIL (``benchmarks/RESULTS.md``, "helper-process mode"). The state averager and
the progress tracker stay in the trainer's process (they move little data).
"""

from __future__ import annotations

from swarmtrain.averaging.process_backend import HelperProcessBackend
from swarmtrain.optim.grad_averager import GradientAverager

__all__ = ["ProcessGradientAverager"]


class ProcessGradientAverager(GradientAverager, HelperProcessBackend):
    """``GradientAverager`` (same keywords) with its all-reduce in a helper process; extra
    keywords: ``dht_kwargs``, ``initial_peers``, ``start_timeout``, ``call_timeout``."""
