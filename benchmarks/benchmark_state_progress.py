"""Cost of the state-download progress bar: one donor, one newcomer (trio DHTs on loopback, one
process); each repetition downloads the same state with the bar off and forced on (drawn to
stderr: send it to /dev/null; the order alternates) and measures the download time and the
event loop's worst lag (a task that sleeps 5 ms and records how late it woke). Prints medians
and the ratio bar on / off::

    PYTHONPATH=. python benchmarks/benchmark_state_progress.py --mib 64 --repeats 10 2>/dev/null
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import trio

from swarmtrain.averaging.state_checks import TensorSpec
from swarmtrain.averaging.state_sharing import StateSharing
from swarmtrain.compression import NoCompression
from swarmtrain.dht import DHT
from swarmtrain.utils.progress import set_progress_bars

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}


async def _lag_watch(worst: list[float], stop: trio.Event) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await trio.sleep(0.005)
        worst[0] = max(worst[0], time.perf_counter() - started - 0.005)


async def run(mib: int, repeats: int) -> dict[bool, list[tuple[float, float]]]:
    tensors = [torch.randn(1024, 256) for _ in range(mib)]  # 1 MiB each
    specs = [TensorSpec.of(t) for t in tensors]

    async def get_state():
        return {}, tensors, None

    common = {"state_compression": NoCompression(), "declare_state_period": 30.0}
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    async with (
        DHT.create(**HOST) as first,
        DHT.create(first.get_visible_maddrs(), **HOST) as second,
    ):
        async with (
            StateSharing.create(
                first, "bench", get_state=get_state, allow_state_sharing=True, **common
            ),
            StateSharing.create(
                second,
                "bench",
                get_state=get_state,
                allow_state_sharing=False,
                serve=False,
                **common,
            ) as newcomer,
        ):
            for repeat in range(repeats):
                for bar in (False, True) if repeat % 2 else (True, False):  # alternate the order
                    set_progress_bars(bar)
                    worst, stop = [0.0], trio.Event()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_lag_watch, worst, stop)
                        started = time.perf_counter()
                        loaded = await newcomer.load_state_from_peers(check=lambda _: specs)
                        elapsed = time.perf_counter() - started
                        stop.set()
                    assert loaded is not None
                    results[bar].append((elapsed, worst[0]))
    set_progress_bars(None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="state size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = trio.run(run, args.mib, args.repeats)
    off, on = results[False], results[True]
    ratios = [b[0] / a[0] for a, b in zip(off, on, strict=True)]
    for name, rows in (("bar off", off), ("bar on", on)):
        seconds = statistics.median(r[0] for r in rows)
        lag = statistics.median(r[1] for r in rows)
        print(
            f"{name}: {seconds:.3f} s per {args.mib} MiB download "
            f"({args.mib / seconds:.0f} MiB/s), worst loop lag {lag * 1e3:.1f} ms "
            f"(medians of {args.repeats})",
        )
    print(
        f"time ratio bar on / off: median {statistics.median(ratios):.3f} "
        f"(per repetition: {', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
