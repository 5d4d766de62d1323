"""``swarmtrain monitor --initial_peers ... [--run_id RUN] [--port 8080]``: a DHT client that
follows one run (or every announced run) and serves a live web dashboard. With
``--checkpoint_dir DIR`` it also saves the run's shared state there every ``--checkpoint_every``
seconds (:mod:`swarmtrain.monitor.checkpoints`), keeping the newest ``--checkpoint_keep``."""

from __future__ import annotations

import functools
import signal
import sys
from contextlib import AsyncExitStack

import trio

from swarmtrain.cli.options import add_option
from swarmtrain.cli.runs import load_known_runs
from swarmtrain.dht import DHT
from swarmtrain.monitor.http import DashboardServer
from swarmtrain.monitor.run_trust import RunTrust
from swarmtrain.monitor.sinks import MetricsSink, TensorBoardSink, WandbSink
from swarmtrain.monitor.state import MonitorState
from swarmtrain.monitor.watch import watch
from swarmtrain.p2p import P2PError
from swarmtrain.p2p.pubsub import PubSub

HELP = "follow a run (or every announced run) and serve a live web dashboard"


def add_arguments(parser) -> None:
    add_option(parser, "--initial_peers", nargs="+", default=[], help="peers to join (required)")
    add_option(parser, "--run_id", default=None, help="the run to follow (default: all announced)")
    add_option(
        parser, "--port", type=int, default=8080, help="dashboard port (default 8080; 0: any)"
    )
    add_option(
        parser,
        "--host",
        default="127.0.0.1",
        help="dashboard address (default 127.0.0.1; 0.0.0.0 to share it)",
    )
    add_option(
        parser,
        "--target_batch_size",
        type=int,
        default=None,
        help="the run's target batch size, to show the time to the next epoch",
    )
    add_option(parser, "--refresh_period", type=float, default=2.0, help="seconds between reads")
    add_option(parser, "--swarm_key_path", default=None, help="swarm key of a private DHT")
    add_option(
        parser,
        "--tensorboard_dir",
        default=None,
        help="also log to TensorBoard (needs tensorboard)",
    )
    add_option(parser, "--wandb_project", default=None, help="also log to wandb (needs wandb)")
    add_option(
        parser,
        "--checkpoint_dir",
        default=None,
        help="save the run's shared state here (needs --run_id; a non-training client)",
    )
    add_option(
        parser,
        "--checkpoint_every",
        type=float,
        default=600.0,
        help="seconds between checkpoints (default 600)",
    )
    add_option(
        parser,
        "--checkpoint_keep",
        type=int,
        default=3,
        help="checkpoints kept, the newest (default 3)",
    )
    add_option(
        parser,
        "--state_prefix",
        default=None,
        help="the averager whose state is saved (default RUN_ID_state_averager, the Optimizer's)",
    )
    add_option(
        parser,
        "--known_runs",
        default=None,
        help="JSON file of run owner keys ({run_id: key}, as `swarmtrain runs` keeps it)",
    )
    add_option(
        parser,
        "--no_gossip",
        action="store_true",
        help="read metrics from the DHT only (default: also follow their gossip)",
    )
    parser.set_defaults(run=run)


def make_sinks(args) -> list[MetricsSink]:
    sinks: list[MetricsSink] = []
    if args.tensorboard_dir:
        sinks.append(TensorBoardSink(args.tensorboard_dir))
    if args.wandb_project:
        sinks.append(WandbSink(args.wandb_project))
    return sinks


async def serve(args, sinks: list[MetricsSink]) -> None:
    state = MonitorState(
        target_batch_size=args.target_batch_size, trust=RunTrust(load_known_runs(args.known_runs))
    )
    server = DashboardServer()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            DHT.create(
                initial_peers=args.initial_peers, client_mode=True, swarm_key=args.swarm_key_path
            ) as dht,
            AsyncExitStack() as stack,
        ):
            pubsub = None
            if not args.no_gossip:
                pubsub = await stack.enter_async_context(PubSub.create(dht.p2p))
            async with trio.open_nursery() as nursery:
                port = await nursery.start(server.serve, args.port, args.host)
                print(f"dashboard at http://{args.host}:{port}/", flush=True)
                if args.checkpoint_dir is not None:
                    from swarmtrain.monitor.checkpoints import checkpoint_loop  # imports torch

                    await nursery.start(
                        functools.partial(
                            checkpoint_loop,
                            dht,
                            args.run_id,
                            args.checkpoint_dir,
                            every=args.checkpoint_every,
                            keep=args.checkpoint_keep,
                            prefix=args.state_prefix,
                            on_saved=lambda path: print(f"saved checkpoint {path}", flush=True),
                        )
                    )
                nursery.start_soon(
                    functools.partial(
                        watch,
                        dht,
                        state,
                        server,
                        args.run_id,
                        args.refresh_period,
                        sinks,
                        pubsub=pubsub,
                    )
                )
                async for signum in signals:
                    print(f"received {signal.Signals(signum).name}, shutting down", flush=True)
                    break
                nursery.cancel_scope.cancel()


def run(args) -> int:
    if not args.initial_peers:
        raise SystemExit("swarmtrain monitor: --initial_peers is required (a peer of the run)")
    if not args.refresh_period > 0:
        raise SystemExit("swarmtrain monitor: --refresh_period must be positive")
    if args.checkpoint_dir is not None:
        if args.run_id is None:
            raise SystemExit(
                "swarmtrain monitor: --checkpoint_dir needs --run_id (the run to save)"
            )
        if not (args.checkpoint_every > 0 and args.checkpoint_keep >= 1):
            raise SystemExit(
                "swarmtrain monitor: --checkpoint_every must be positive, --checkpoint_keep >= 1"
            )
    try:
        sinks = make_sinks(args)
    except ImportError as e:
        print(f"swarmtrain monitor: {e}", file=sys.stderr)
        return 1
    try:
        trio.run(serve, args, sinks)
    except (P2PError, ValueError, OSError) as e:
        print(f"swarmtrain monitor: {e}", file=sys.stderr)
        return 1
    finally:
        for sink in sinks:
            sink.close()
    return 0
