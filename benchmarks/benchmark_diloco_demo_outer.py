"""DiLoCo on the churn soak's classifier without network or churn: why its eval loss rose.

The DiLoCo churn soak (``tests/test_netlab_churn.py``) trains the ``swarmtrain demo``
classifier with 8 shards, Adam (lr 3e-3, 16 samples per step) and H = 50 inner steps, exactly
as ``tests/netlab/train_peer.py`` does. Here the same workers run in one process
(:class:`~swarmtrain.optim.diloco_core.OuterState`, plain mean of the pseudo-gradients), so any
rise of the eval loss comes from the outer optimizer, not from the network or the churn.
Deterministic on a given machine::

    nice -n 5 python benchmarks/benchmark_diloco_demo_outer.py --outer-steps 25

Prints, per outer optimizer (SGD lr / Nesterov momentum), the eval loss every few outer steps,
its lowest value, the last one and ``last / lowest`` (the baseline is the lowest of the same
run), the train loss and the parameter norm at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from swarmtrain.cli.demo_peer import evaluate, make_data, make_model
from swarmtrain.optim.diloco_core import OuterState

SHARDS, BATCH, INNER_LR = 8, 16, 0.003


def run(workers: int, inner_steps: int, outer_steps: int, lr: float, momentum: float) -> dict:
    (points, labels), eval_set = make_data()
    models = [make_model() for _ in range(workers)]
    inner = [torch.optim.Adam(m.parameters(), lr=INNER_LR) for m in models]
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(workers)]
    shards = [torch.arange(i, len(points), SHARDS) for i in range(workers)]
    outer = OuterState(
        list(models[0].parameters()),
        lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, nesterov=momentum > 0),
    )
    losses = []
    for _ in range(outer_steps):
        pseudo = []
        for model, opt, gen, shard in zip(models, inner, generators, shards, strict=True):
            for _ in range(inner_steps):
                rows = shard[torch.randint(0, len(shard), (BATCH,), generator=gen)]
                loss = torch.nn.functional.cross_entropy(model(points[rows]), labels[rows])
                loss.backward()
                opt.step()
                opt.zero_grad()
            pseudo.append(outer.pseudo_gradient(list(model.parameters())))
        outer.apply_outer_step([sum(t) / workers for t in zip(*pseudo, strict=True)])
        for model in models:
            outer.copy_to(list(model.parameters()))
        losses.append(evaluate(models[0], eval_set)[0])
    with torch.no_grad():
        norm = float(torch.cat([p.reshape(-1) for p in models[0].parameters()]).norm())
    return {
        "outer_lr": lr,
        "outer_momentum": momentum,
        "eval_loss_every_3": [round(v, 4) for v in losses[::3]],
        "lowest": round(min(losses), 4),
        "lowest_at": losses.index(min(losses)) + 1,
        "last": round(losses[-1], 4),
        "last_over_lowest": round(losses[-1] / min(losses), 2),
        "train_loss_last": round(evaluate(models[0], (points, labels))[0], 5),
        "param_norm_last": round(norm, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--outer-steps", type=int, default=25)
    parser.add_argument(
        "--configs",
        default="0.7/0.9,1.0/0,0.5/0.5",
        help="outer SGD lr/momentum pairs (0.7/0.9: DiLoCo's default; 1.0/0: plain averaging)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    for config in args.configs.split(","):
        lr, momentum = (float(x) for x in config.split("/"))
        result = run(args.workers, args.inner_steps, args.outer_steps, lr, momentum)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
