"""Training behind real NATs (slow; root only): three peers behind NATs (two cone, one
symmetric) and two public relay/bootstrap peers run ``swarmtrain.Optimizer`` for two minutes,
then ``DiLoCoOptimizer``, in a ``netlab`` lab. Every peer must end at the same epoch, halve
its eval loss and average with others in most epochs (the parameter gaps are printed)."""

from __future__ import annotations

import netlab
import pytest
from netlab.nat_swarm import TRAIN_SCRIPT, NatSwarm

HOMES = {"a": "cone", "b": "cone", "c": "symmetric"}


def _run(mode: str, seconds: float) -> dict[str, dict]:
    reason = netlab.iptables_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netlab.Lab() as lab:
        swarm = NatSwarm(
            lab,
            HOMES,
            runner=TRAIN_SCRIPT,
            runner_options={"mode": mode, "peers": len(HOMES)},
        )
        swarm.ask_all({name: {"op": "wait_circuit", "timeout": 60} for name in HOMES}, 90)
        train = {"op": "train", "seconds": seconds, "peers": len(HOMES), "run_id": f"nat{mode}"}
        trained = swarm.ask_all({name: train for name in HOMES}, seconds + 120)
        finish = {"op": "finish", "epoch": max(t["epoch"] for t in trained.values()) + 1}
        done = swarm.ask_all({name: finish for name in HOMES}, 180)
        for result in done.values():  # which path each pair used, by peer name
            result["paths"] = {swarm.name_of(p): kinds for p, kinds in result["paths"].items()}
        print(mode, {n: {k: v for k, v in d.items() if k != "params"} for n, d in done.items()})
        return done


def _check(done: dict[str, dict], min_epochs: int) -> None:
    epochs = {d["epoch"] for d in done.values()}
    assert len(epochs) == 1, done  # everyone finished the same epoch (outer step)
    epoch = epochs.pop()
    assert epoch >= min_epochs, done
    for result in done.values():
        assert result["eval_loss_after"] < result["eval_loss_before"] / 2
        # every peer averaged with others in most epochs (the goal, every epoch in a group of
        # all three, held in 53 of 54 epochs at load 13-18 but not in every loaded run:
        # docs/reliability.md, "The matchmaking race over relays"); the group sizes and
        # partial rounds are printed
        assert result["averaged"] >= epoch // 2, result
    # the symmetric NAT defeats hole punching: c reaches a and b through a relay only
    for name in "ab":
        assert "direct" not in done["c"]["paths"].get(name, []), done["c"]["paths"]
    reference = done["a"]["params"]
    for name in "bc":
        gap = max(abs(x - y) for x, y in zip(reference, done[name]["params"], strict=True))
        print(f"largest parameter gap a-{name}: {gap:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_optimizer_trains_for_two_minutes_behind_nats():
    _check(_run("optimizer", 120), min_epochs=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diloco_trains_behind_nats():
    _check(_run("diloco", 60), min_epochs=2)
