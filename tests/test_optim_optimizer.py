"""swarmtrain.Optimizer: peers in threads over real DHTs on loopback, training a regression."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import trio

from swarmtrain.averaging.state_sharing import state_sharing_key
from swarmtrain.dht import DHT, PeerRecordValidator, get_dht_time
from swarmtrain.optim import Optimizer
from swarmtrain.optim.grad_scaler import GradScaler
from swarmtrain.utils.background import BackgroundRuntime

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FEATURES, BATCH, TARGET = 8, 4, 96
FAST = {
    "matchmaking_time": 1.0,
    "averaging_timeout": 15.0,
    "load_state_timeout": 15.0,
    # min_stall_time: a peer 2+ epochs behind its only partner follows it after 5 s (30 s by
    # default; epochs here last a second or two)
    "tracker_opts": {"gossip_period": 0.1, "min_refresh_period": 0.2, "min_stall_time": 5.0},
}

_generator = torch.Generator().manual_seed(0)
TRUE_W = torch.randn(FEATURES, 1, generator=_generator)
X = torch.randn(600, FEATURES, generator=_generator)
Y = X @ TRUE_W + 0.01 * torch.randn(600, 1, generator=_generator)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(FEATURES, 1)


def full_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(X), Y).item()


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def dhts() -> Iterator[Callable[[int], list[DHT]]]:
    """``make(n)`` starts ``n`` more DHTs, all bootstrapped from the first; all closed after."""
    made: list[DHT] = []

    def make(n: int) -> list[DHT]:
        new = []
        for _ in range(n):
            initial = made[0].get_visible_maddrs() if made else []
            dht = DHT(initial, **HOST)
            made.append(dht)
            new.append(dht)
        return new

    yield make
    for dht in reversed(made):
        dht.shutdown()
    assert BackgroundRuntime.active_references() == 0


class Peer:
    """One trainer: a model, its shard of the data, its Optimizer, and what it saw per epoch."""

    def __init__(
        self, dht: DHT, index: int, *, seed: int = 0, model: torch.nn.Module | None = None, **opts
    ):
        self.model = make_model(seed) if model is None else model
        self.shard = torch.arange(index, len(X), 3)
        self.position = 0
        self.opt = Optimizer(
            dht=dht,
            run_id="regression",
            target_batch_size=opts.pop("target_batch_size", TARGET),
            params=self.model.parameters(),
            **{
                "batch_size_per_step": BATCH,
                "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
                **FAST,
                **opts,
            },
        )
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.samples: dict[int, float] = {}

    def train_until(
        self,
        epoch: int,
        deadline: float = 40.0,
        pause: float = 0.05,
        grad_scaler: GradScaler | None = None,
    ) -> None:
        """Train until ``local_epoch`` reaches ``epoch`` (with ``grad_scaler``: torch's AMP
        loop, ``scale(loss).backward(); step(opt); update()``)."""
        stop = time.monotonic() + deadline
        while self.opt.local_epoch < epoch:
            assert time.monotonic() < stop, f"stuck at epoch {self.opt.local_epoch}"
            rows = self.shard[self.position : self.position + BATCH]
            self.position = (self.position + BATCH) % (len(self.shard) - BATCH)
            before = self.opt.local_epoch
            loss = torch.nn.functional.mse_loss(self.model(X[rows]), Y[rows])
            if grad_scaler is None:
                loss.backward()
                self.opt.step()
            else:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(self.opt)
                grad_scaler.update()
            if not self.opt.reuse_grad_buffers:
                self.opt.zero_grad()
            if self.opt.local_epoch != before:
                self.snapshots[self.opt.local_epoch] = params_of(self.model)
                self.samples[self.opt.local_epoch] = self.opt.last_epoch_samples
            time.sleep(pause)


def in_threads(*fns: Callable[[], object]) -> None:
    with ThreadPoolExecutor(len(fns)) as pool:
        for future in [pool.submit(fn) for fn in fns]:
            future.result(timeout=60)


def assert_same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def agree_after_a_state_round(peers: list) -> None:
    """All ``peers`` average their states in one synchronous round (``average_state``), which
    must gather every one of them; then they hold the same model. Whether every training
    round averaged (a loaded machine may make one fail, logged) does not matter here."""
    groups: list = [None] * len(peers)

    def average(i: int) -> None:
        groups[i] = peers[i].opt.average_state()

    in_threads(*(lambda i=i: average(i) for i in range(len(peers))))
    assert all(group is not None and len(group) == len(peers) for group in groups), groups
    for peer in peers[1:]:
        assert_same_params(params_of(peers[0].model), params_of(peer.model))


def test_peers_advance_together_and_learn(dhts):
    # Synchronous state rounds: a background round snapshots each peer whenever its worker
    # gets to it, so with delay_state_averaging peers agree only approximately (as in
    # hivemind); the delayed modes are covered in test_optim_optimizer_modes.py.
    peers = [Peer(dht, i, delay_state_averaging=False) for i, dht in enumerate(dhts(3))]
    try:
        initial_loss = full_loss(peers[0].model)
        in_threads(*(lambda p=p: p.train_until(4) for p in peers))
        common = set.intersection(*(set(p.snapshots) for p in peers))
        assert len(common) >= 3, [sorted(p.snapshots) for p in peers]
        # Where epochs end (how many samples) depends on the box's load (the ETA extrapolates
        # through stalls): tests/test_optim_epoch_core.py checks that logic on simulated
        # swarms, deterministically; here only what holds under any load.
        assert all(sum(p.samples[epoch] for p in peers) > 0 for epoch in common)
        assert {p.opt.local_epoch for p in peers} == {4}
        assert peers[0].opt.offload_optimizer  # the default with an optimizer factory
        assert all(p.opt.epochs_averaged >= 2 for p in peers)
        assert all(p.opt.is_synchronized_with_peers() for p in peers)
        assert full_loss(peers[0].model) < 0.5 * initial_loss
        agree_after_a_state_round(peers)
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_wait_for_peers_counts_announced_trainers_not_auxiliaries(dhts):
    first, second, helper = dhts(3)
    peers = [Peer(first, 0), Peer(second, 1)]
    aux = Optimizer(
        dht=helper,
        run_id="regression",
        target_batch_size=TARGET,
        params=make_model().parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        auxiliary=True,
        **FAST,
    )
    try:
        assert peers[0].opt.tracker.global_progress.num_peers == 0  # no samples, no record
        seen: list[int] = []
        in_threads(*(lambda p=p: seen.append(p.opt.wait_for_peers(2, timeout=20)) for p in peers))
        assert seen == [2, 2]
        assert aux.wait_for_peers(2, timeout=20) == 2
        started = time.monotonic()
        assert peers[0].opt.wait_for_peers(3, timeout=1.0) == 2  # the auxiliary is not counted
        assert time.monotonic() - started >= 1.0
    finally:
        for opt in (aux, *(p.opt for p in peers)):
            opt.shutdown()


def test_peers_with_different_models_get_a_model_mismatch_warning(dhts):
    other_model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 4), torch.nn.Linear(4, 1))
    fast_fail = {"averaging_timeout": 3.0}
    peers = [Peer(dhts(1)[0], 0, **fast_fail), Peer(dhts(1)[0], 1, model=other_model, **fast_fail)]
    try:
        in_threads(*(lambda p=p: p.opt.wait_for_peers(2, timeout=20) for p in peers))
        in_threads(*(lambda p=p: p.train_until(3, deadline=60.0) for p in peers))
        for peer in peers:
            assert peer.opt.epochs_averaged == 0  # never averaged across models
            kinds = [w.kind for w in peer.opt.health.given]
            assert kinds == ["model_mismatch"], kinds
            assert "same model" in peer.opt.health.given[0].message
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_late_joiner_loads_state_and_catches_up(dhts):
    # synchronous state rounds: a delayed one may overlap the next epoch's optimizer step (the
    # epoch skips its own round then), so peers agree only approximately (as in hivemind)
    sync = {"delay_state_averaging": False}
    first = [Peer(dht, i, **sync) for i, dht in enumerate(dhts(2))]
    joiner = None
    try:
        in_threads(*(lambda p=p: p.train_until(3) for p in first))
        joiner = Peer(dhts(1)[0], 2, seed=123, **sync)  # other initial parameters
        assert not joiner.opt.is_synchronized_with_peers()
        rows = joiner.shard[:BATCH]
        torch.nn.functional.mse_loss(joiner.model(X[rows]), Y[rows]).backward()
        joiner.opt.step()  # behind by more than one epoch: loads the state instead
        joiner.opt.zero_grad()
        assert joiner.opt.local_epoch == 3
        loaded = params_of(joiner.model)  # exactly one donor's (they differ if a round failed)
        assert any(all(map(torch.equal, loaded, params_of(p.model))) for p in first)
        assert joiner.opt.is_synchronized_with_peers()

        peers = [*first, joiner]
        in_threads(*(lambda p=p: p.train_until(5) for p in peers))
        for peer in peers[1:]:
            assert peer.opt.local_epoch == 5
        assert all(torch.isfinite(t).all() for p in peers for t in p.snapshots[5])
        agree_after_a_state_round(peers)
    finally:
        for peer in [*first, *([joiner] if joiner else [])]:
            peer.opt.shutdown()


@pytest.mark.parametrize(
    "stepped_before", [False, True], ids=["loads-the-state", "takes-the-group-epoch"]
)
def test_a_peer_one_epoch_behind_gets_back_in_step_within_one_epoch(dhts, stepped_before):
    # The first-use review (section 2): a peer that sat out until the swarm was one epoch ahead
    # ended its epoch alone ("the swarm moved past epoch N"), and its synchronous state round
    # waited for the swarm's, at the swarm's next epoch end: it entered each epoch as the swarm
    # left it, one epoch behind for good, its gradients never averaged again. Now it catches
    # up: if its first look at the epoch saw the swarm past it, it loads the state; if it had
    # seen the swarm in its epoch (stepped_before), its state round makes it hold the group's
    # state, and it takes the group's epoch.
    target = 2 * TARGET  # epochs of ~2 s: the late peer's failed round fits well inside one
    peers = [
        Peer(dht, i, delay_state_averaging=False, target_batch_size=target)
        for i, dht in enumerate(dhts(3))
    ]
    late, others = peers[2], peers[:2]
    try:
        in_threads(*(lambda p=p: p.opt.wait_for_peers(3, timeout=20) for p in peers))
        in_threads(*(lambda p=p: p.train_until(2, pause=0.1) for p in peers))
        late.snapshots.clear()
        behind_at: list[int] = []

        def sit_out_one_epoch_then_train() -> None:
            opt, tracker = late.opt, late.opt.tracker
            if stepped_before:
                rows = late.shard[:BATCH]
                torch.nn.functional.mse_loss(late.model(X[rows]), Y[rows]).backward()
                opt.step()
                opt.zero_grad()
            stop = time.monotonic() + 30
            while not (
                tracker.global_epoch == opt.local_epoch + 1
                and tracker.global_progress.samples_accumulated > 0
            ):  # the others finished our epoch without us and work on the next one
                assert time.monotonic() < stop and tracker.global_epoch <= opt.local_epoch + 1
                time.sleep(0.01)
            behind_at.append(opt.local_epoch)
            late.train_until(5, pause=0.1)

        in_threads(
            sit_out_one_epoch_then_train, *(lambda p=p: p.train_until(5, pause=0.1) for p in others)
        )
        (epoch,) = behind_at
        # in step by the end of the swarm's epoch (epoch + 1), holding the others' model (the
        # old code reached epoch + 1 there, with the model the others had at epoch + 2)
        caught_up = min(late.snapshots)
        assert caught_up <= epoch + 2, sorted(late.snapshots)
        # (on a loaded box another peer may miss a round too, and catch up past this epoch)
        holders = [other for other in others if caught_up in other.snapshots]
        assert holders, (caught_up, [sorted(other.snapshots) for other in others])
        for other in holders:
            assert_same_params(late.snapshots[caught_up], other.snapshots[caught_up])
        assert late.opt.local_epoch == 5
        assert {p.opt.local_epoch for p in others} == {5}
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_local_updates_average_the_state(dhts):
    peers = [
        Peer(dht, i, use_local_updates=True, delay_state_averaging=False)
        for i, dht in enumerate(dhts(2))
    ]
    try:
        initial_loss = full_loss(peers[0].model)
        in_threads(*(lambda p=p: p.train_until(2) for p in peers))
        assert peers[0].opt.grad_averager is None
        for epoch in (1, 2):
            assert_same_params(peers[0].snapshots[epoch], peers[1].snapshots[epoch])
        assert full_loss(peers[0].model) < initial_loss
    finally:
        for peer in peers:
            peer.opt.shutdown()


def test_state_dict_round_trip_and_context_manager(dhts):
    (dht,) = dhts(1)
    model = make_model()
    with Optimizer(
        dht=dht,
        run_id="alone",
        target_batch_size=8,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        scheduler=None,
        **FAST,
    ) as opt:
        assert opt.param_groups[0]["lr"] == 0.01
        with pytest.raises(ValueError, match="batch_size"):
            opt.step()
        model(X[:2]).sum().backward()
        opt.step(batch_size=2)
        state = opt.state_dict()
        assert state["swarmtrain_local_epoch"] == opt.local_epoch
        state["swarmtrain_local_epoch"] = 7
        opt.load_state_dict(state)
        assert opt.local_epoch == 7
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    assert not opt.tracker.is_alive() and not opt.state_averager.is_alive()
    assert opt.local_epoch == 7  # still readable, as in hivemind
    with pytest.raises(RuntimeError, match="shut down"):
        opt.step(batch_size=2)


def test_a_state_round_on_demand_averages_the_models(dhts):
    """``opt.state_averager.step(averaging_round=True)`` (or ``opt.average_state()``): one
    synchronous state round, e.g. a final sync after training (the churn soak's)."""
    first, second = dhts(2)
    peers = [Peer(d, i, seed=i, delay_state_averaging=False) for i, d in enumerate((first, second))]
    try:
        before = [params_of(p.model) for p in peers]
        groups: list = [None, None]

        def sync(i: int) -> None:
            step = peers[i].opt.state_averager.step
            groups[i] = step(averaging_round=True, averaging_opts={"timeout": 30.0})

        in_threads(lambda: sync(0), lambda: sync(1))
        assert [len(g or ()) for g in groups] == [2, 2], groups
        mean = [(a + b) / 2 for a, b in zip(*before, strict=True)]
        for peer in peers:
            for got, want in zip(params_of(peer.model), mean, strict=True):
                torch.testing.assert_close(got, want)
        assert all(p.opt.state_rounds_averaged == 1 for p in peers)
        with pytest.raises(NotImplementedError, match="TrainingStateAverager of your own"):
            peers[0].opt.state_averager.step(optimizer_step=True)
    finally:
        for peer in peers:
            peer.opt.shutdown()


def start_a_lone_state_round(opt: Optimizer) -> None:
    """A delayed state round as an earlier epoch starts it, looking for peers (alone: until
    its 5 s timeout)."""
    aio = opt._opt  # the AsyncOptimizer behind the blocking facade

    async def start() -> None:
        control = aio._state_service.start_step(
            gather=aio.local_epoch, timeout=5.0, require_trigger=True
        )
        await trio.to_thread.run_sync(aio._state._load_round_inputs, control)
        control.allow_allreduce()
        aio._delayed.start(state_round=control, inputs_loaded=True)

    opt._call(start)


@pytest.mark.parametrize("form", ["instance", "factory"])
def test_an_epoch_does_not_wait_for_the_last_state_round(dhts, form):
    """With the defaults (delay_state_averaging=True) an epoch's optimizer step does not wait
    for a state round still in matchmaking, for an optimizer instance (no offloading) as for a
    factory (tests/test_optim_averagers.py checks how a delta-rule round lands)."""
    (dht,) = dhts(1)
    model = make_model()
    if form == "instance":
        optimizer = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    else:
        optimizer = {
            "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
            "params": model.parameters(),
        }
    with Optimizer(
        dht=dht,
        run_id=f"state_round_{form}",
        target_batch_size=2 * BATCH,
        batch_size_per_step=BATCH,
        **optimizer,
        **FAST,
    ) as opt:
        assert opt.delay_state_averaging and opt.offload_optimizer == (form == "factory")
        start_a_lone_state_round(opt)
        before = params_of(model)
        while opt.local_epoch < 1:
            torch.nn.functional.mse_loss(model(X[:BATCH]), Y[:BATCH]).backward()
            opt.step()
            opt.zero_grad()
        assert opt.state_averager.averaging_in_progress  # the epoch ended without waiting
        stepped = params_of(model)
        assert all(not torch.equal(a, b) for a, b in zip(before, stepped, strict=True))
        opt.state_averager.wait_for_delayed_updates()  # alone: the round fails
        opt.state_averager.step()
        assert_same_params(params_of(model), stepped)  # and changes nothing


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"run_id": ""}, ValueError, "run_id"),
        ({"run_id": "my.run"}, ValueError, "run_id must not contain '.'"),
        ({"run_id": "my::run"}, ValueError, "run_id must not contain"),
        ({"target_batch_size": 0}, ValueError, "target_batch_size"),
        ({"target_batch_size": 1.5}, TypeError, "target_batch_size"),
        ({"batch_size_per_step": -1}, ValueError, "batch_size_per_step"),
        ({"matchmaking_time": 0}, ValueError, "matchmaking_time"),
        ({"average_state_every": 0}, ValueError, "average_state_every"),
        ({"auxiliary": True, "client_mode": True}, ValueError, "auxiliary"),
        ({"auxiliary": True, "use_local_updates": True}, ValueError, "auxiliary"),
        ({"auxiliary": True, "reuse_grad_buffers": True}, ValueError, "auxiliary"),
        ({"next_chunk_timeout": 0}, ValueError, "next_chunk_timeout"),
        ({"allreduce_timeout": "1"}, TypeError, "allreduce_timeout"),
        ({"offload_optimizer": True}, ValueError, "factory"),
        ({"delay_optimizer_step": True}, ValueError, "factory"),
        ({"delay_grad_averaging": True, "delay_optimizer_step": False}, ValueError, "needs"),
        (
            {"factory": True, "delay_optimizer_step": True, "offload_optimizer": False},
            ValueError,
            "offload_optimizer",
        ),
        (
            {"factory": True, "delay_optimizer_step": True, "delay_state_averaging": False},
            ValueError,
            "delay_state_averaging",
        ),
        ({"use_local_updates": True, "reuse_grad_buffers": True}, ValueError, "reuse_grad"),
        ({"use_local_updates": True, "delay_grad_averaging": True}, ValueError, "delay_grad"),
        ({"use_local_updates": True, "grad_averager_factory": dict}, ValueError, "factory"),
        ({"grad_averager_factory": 3}, TypeError, "grad_averager_factory"),
    ],
)
def test_arguments_are_validated_before_the_network(kwargs, error, match):
    model = make_model()
    kwargs = dict(kwargs)
    if kwargs.pop("factory", False):
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
        kwargs["params"] = model.parameters()
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = {
        "dht": None,  # never touched
        "run_id": "run",
        "target_batch_size": 8,
        "optimizer": optimizer,
        "client_mode": False,
        **kwargs,
    }
    with pytest.raises(error, match=match):
        Optimizer(**args)


def test_a_factory_needs_params(dhts):
    (dht,) = dhts(1)
    with pytest.raises(ValueError, match="params"):
        Optimizer(
            dht=dht,
            run_id="run",
            target_batch_size=8,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )


@pytest.mark.parametrize("client_mode", [None, False])
@pytest.mark.parametrize("dht", [None, "/ip4/127.0.0.1/tcp/31337"])
def test_dht_must_be_a_dht(dht, client_mode):
    model = make_model()
    with pytest.raises(TypeError, match=r"dht must be a running swarmtrain\.DHT, got"):
        Optimizer(
            dht=dht,
            run_id="run",
            target_batch_size=8,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            client_mode=client_mode,
        )


def test_an_optimizer_whose_dht_was_shut_down_raises(dhts):
    (dht,) = dhts(1)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = Optimizer(
        dht=dht, run_id="orphan", target_batch_size=8, batch_size_per_step=2, optimizer=sgd, **FAST
    )
    try:
        model(X[:2]).sum().backward()
        opt.step()
        dht.shutdown()
        # it used to go on training alone, silently
        for call in (opt.step, opt.load_state_from_peers, lambda: opt.wait_for_peers(2, 1.0)):
            with pytest.raises(RuntimeError, match="the DHT of this Optimizer was shut down"):
                call()
        with pytest.raises(RuntimeError, match="dht is not running"):
            Optimizer(
                dht=dht, run_id="orphan", target_batch_size=8, optimizer=sgd, client_mode=False
            )
    finally:
        opt.shutdown()


def test_a_lone_peer_has_nothing_to_load_and_returns_at_once(dhts, caplog):
    (dht,) = dhts(1)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with Optimizer(dht=dht, run_id="lonely", target_batch_size=8, optimizer=sgd) as opt:
        caplog.set_level(logging.INFO, logger="swarmtrain.optim.optimizer")
        started = time.monotonic()
        assert opt.load_state_from_peers(timeout=60.0) is False
        assert time.monotonic() - started < 10.0  # it waited the whole timeout (hivemind: none)
        assert "no peer shares a training state" in caplog.text
        assert "no other peers found" not in caplog.text


def test_a_failing_donor_is_reported_once_with_the_reason(dhts, caplog):
    first, other = dhts(2)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with Optimizer(dht=first, run_id="baddonor", target_batch_size=8, optimizer=sgd) as opt:
        # a peer declares a state but serves none (no averager of this run runs there); it
        # registers the key so its declaration is signed (readers drop unsigned ones)
        key = state_sharing_key("baddonor_state_averager")
        other.add_validators([PeerRecordValidator([key])])
        assert other.store(key, 5.0, get_dht_time() + 30, subkey=other.peer_id.to_bytes())
        caplog.set_level(logging.DEBUG, logger="swarmtrain.averaging.state_sharing")
        assert opt.load_state_from_peers(timeout=4.0) is False
        said = [r for r in caplog.records if "could not load the state of" in r.getMessage()]
        assert len(said) >= 2  # it retried while the donor was declared...
        warned = [r.getMessage() for r in said if r.levelno == logging.WARNING]
        assert len(warned) == 1, warned  # ...and said why once, not once per attempt
        assert str(other.peer_id) in warned[0] and "no handler named" in warned[0]
        final = [r.getMessage() for r in caplog.records if "in 4 s" in r.getMessage()]
        assert len(final) == 1 and str(other.peer_id) in final[0], final


def test_a_peer_behind_with_no_donor_takes_the_swarm_epoch(dhts):
    first, second = dhts(2)
    ahead = Peer(first, 0, target_batch_size=8)
    behind = None
    try:
        ahead.opt.state_averager.allow_state_sharing = False  # nobody can serve a state
        ahead.train_until(3)
        behind = Peer(second, 1, target_batch_size=8)
        stop = time.monotonic() + 20
        while behind.opt.global_epoch < 3:
            assert time.monotonic() < stop, "the swarm's epoch never reached the newcomer"
            behind.opt.tracker.refresh(timeout=5)
        rows = behind.shard[:BATCH]
        torch.nn.functional.mse_loss(behind.model(X[rows]), Y[rows]).backward()
        started = time.monotonic()
        behind.opt.step()  # 3 epochs behind, nothing to load: it used to retry every step
        assert behind.opt.local_epoch == 3
        assert time.monotonic() - started < 10.0  # not load_state_timeout
    finally:
        for peer in (ahead, *([behind] if behind else [])):
            peer.opt.shutdown()


def test_messages_name_the_optimizer_keyword_for_the_matchmaking_time(dhts):
    (dht,) = dhts(1)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"request_timeout \(3.0\) must be below matchmaking_time"):
        Optimizer(
            dht=dht,
            run_id="keywords",
            target_batch_size=8,
            optimizer=sgd,
            matchmaking_time=2.0,
            averager_opts={"request_timeout": 3.0},
        )
    with Optimizer(dht=dht, run_id="keywords", target_batch_size=8, optimizer=sgd) as opt:
        for averager in (opt.state_averager, opt.grad_averager):
            assert averager.config.matchmaking_time_keyword == "matchmaking_time"


def test_the_state_averager_view_passes_switches_and_refuses_other_sets(dhts):
    """``opt.state_averager``: its switches reach the trio averager; any other attribute set
    raises (it would change only the view, or a torch side the optimizer does not consult)."""
    (dht,) = dhts(1)
    model = make_model()
    with Optimizer(
        dht=dht,
        run_id="view",
        target_batch_size=8,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        **FAST,
    ) as opt:
        view = opt.state_averager
        view.allow_state_sharing = False
        assert view.allow_state_sharing is False
        assert opt._opt._state_service.allow_state_sharing is False
        view.state_sharing_priority = 5.0
        assert opt._opt._state_service.state_sharing_priority == 5.0
        with pytest.raises(AttributeError, match="round_observer cannot be set"):
            view.round_observer = lambda gathered, epoch: None
        assert view.round_observer is None
        with pytest.raises(AttributeError, match="local_epoch cannot be set"):
            view.local_epoch = 3
        assert opt.local_epoch == 0 and "round_observer" not in vars(view)
