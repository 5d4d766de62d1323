"""Blocking ``TrainingStateAverager.step`` latency, one peer (no rounds): a plain optimizer
step (``here``) and the start of a delayed one (``delayed``), medians over 200 steps each.

Compare two trees: ``PYTHONPATH=<tree> python benchmarks/benchmark_state_averager_step.py``.
"""

import statistics
import time

import torch

import swarmtrain
from swarmtrain.dht import DHT
from swarmtrain.optim import TrainingStateAverager

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
dht = DHT(**HOST)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
avg = TrainingStateAverager(
    dht=dht,
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
    params=model.parameters(),
    offload_optimizer=True,
    prefix="bench",
    min_matchmaking_time=1.0,
    request_timeout=0.5,
)
x = torch.randn(32, 256)
times = {"here": [], "delayed": []}
for mode in ("here", "delayed", "here", "delayed"):
    for _ in range(100):
        model(x).square().mean().backward()
        t = time.perf_counter()
        if mode == "here":
            avg.step(optimizer_step=True, zero_grad=True)
        else:
            avg.step(optimizer_step=True, delay_optimizer_step=True, delay_averaging=True)
            model.zero_grad()
        times[mode].append(time.perf_counter() - t)
    avg.wait_for_delayed_updates()
print(
    swarmtrain.__file__,
    {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()},
    "ms median",
)
avg.shutdown()
dht.shutdown()
