import time
import torch
from test_optim_optimizer import Peer, dhts, in_threads, params_of, agree_after_a_state_round, X, Y, BATCH  # noqa: F401
from swarmtrain.dht import get_dht_time


def dump(peers, t0):
    for i, p in enumerate(peers):
        core = p.opt.tracker._tracker()._core
        v = core._votes
        now = get_dht_time()
        print(f"peer{i} id={core.local_key.hex()[-8:]} local={p.opt.local_epoch} global={core.global_progress.epoch}"
              f" partners={[ (k.hex()[-8:], e) for k, e in v.partners.items()]} live_partners={len(v.live_partners)}"
              f" known={[k.hex()[-8:] for k in v.known]} sources={ {k.hex()[-8:]: [s.hex()[-8:] for s in ss] for k, ss in v.sources.items()} }"
              f" peers={ {k.hex()[-8:]: r.epoch for k, r in core.peers(now).items()} } in_epoch={now - core._local_epoch_started_at:.1f}"
              f" bound={core.stall_bound():.1f} lead={core.plausible_lead(now - core._local_epoch_started_at)} followed={v.followed}"
              f" t={time.monotonic() - t0:.1f}", flush=True)


def test_probe(dhts):  # noqa: F811
    sync = {"delay_state_averaging": False}
    first = [Peer(dht, i, **sync) for i, dht in enumerate(dhts(2))]
    joiner = None
    try:
        in_threads(*(lambda p=p: p.train_until(3) for p in first))
        joiner = Peer(dhts(1)[0], 2, seed=123, **sync)
        rows = joiner.shard[:BATCH]
        torch.nn.functional.mse_loss(joiner.model(X[rows]), Y[rows]).backward()
        joiner.opt.step()
        joiner.opt.zero_grad()
        peers = [*first, joiner]
        t0 = time.monotonic()
        import threading
        stop = threading.Event()
        def watch():
            while not stop.wait(5):
                dump(peers, t0)
        w = threading.Thread(target=watch, daemon=True); w.start()
        try:
            in_threads(*(lambda p=p: p.train_until(5) for p in peers))
        finally:
            stop.set()
            dump(peers, t0)
        print("OK in", time.monotonic() - t0, flush=True)
    finally:
        for peer in [*first, *([joiner] if joiner else [])]:
            peer.opt.shutdown()
