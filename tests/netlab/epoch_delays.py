"""How late each peer's epoch changes reached the others' progress trackers, from the logs of a
``netlab.nat_training`` run (root not needed: it only reads files).

``PYTHONPATH=tests python -m netlab.epoch_delays OUT LOG_DIR``: OUT is the run's printed output
(its ``startup`` line names the peers), LOG_DIR its per-peer logs. For every peer's change to
epoch E >= 1 (its ``entered epoch E`` line) and every other peer, the delay until that peer's
tracker first logged ``peer X at epoch E via gossip|fetch``: first by either channel, by gossip,
and by DHT fetch alone; plus how long the fetches took. Used in docs/reliability.md ("The
tracker's epoch over relays").
"""

from __future__ import annotations

import ast
import collections
import re
import statistics
import sys

ENTERED = re.compile(r"([\d.]+) \S+ \S+: entered epoch (\d+)")
HEARD = re.compile(r"([\d.]+) \S+ \S+: peer (\S+) at epoch (\d+) via (\w+)")
FETCH_TOOK = re.compile(r"fetch took ([\d.]+) s")


def summary(values: list[float]) -> str:
    if not values:
        return "n=0"
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return (
        f"n={len(values)} median {statistics.median(values):.2f} p90 {p90:.2f} max {values[-1]:.2f}"
    )


def main(out_path: str, log_dir: str) -> None:
    with open(out_path) as file:
        found = re.search(r"startup [\d.]+ (\{.*\})", file.read())
    assert found, "no startup line"
    ids: dict[str, str] = ast.literal_eval(found.group(1))
    names = list(ids)
    by_short = {peer_id[-12:]: name for name, peer_id in ids.items()}
    entered: dict[tuple[str, int], float] = {}
    heard: dict[str, dict[tuple[str, int, str], float]] = collections.defaultdict(dict)
    fetch_took: list[float] = []
    for index, name in enumerate(names):
        with open(f"{log_dir}/peer{index}.log") as file:
            for line in file:
                if m := ENTERED.match(line):
                    entered[(name, int(m.group(2)))] = float(m.group(1))
                elif m := HEARD.match(line):
                    key = (by_short.get(m.group(2), m.group(2)), int(m.group(3)), m.group(4))
                    heard[name].setdefault(key, float(m.group(1)))
                if m := FETCH_TOOK.search(line):
                    fetch_took.append(float(m.group(1)))
    first: list[float] = []
    channels: dict[str, list[float]] = collections.defaultdict(list)
    firsts_by: collections.Counter[str] = collections.Counter()
    for observer in names:
        for owner, epoch in {(o, e) for o, e, _ in heard[observer]}:
            changed = entered.get((owner, epoch))
            if changed is None or epoch == 0:
                continue
            times = {
                channel: heard[observer][(owner, epoch, channel)]
                for channel in ("gossip", "fetch")
                if (owner, epoch, channel) in heard[observer]
            }
            channel, when = min(times.items(), key=lambda item: item[1])
            firsts_by[channel] += 1
            first.append(when - changed)
            for name, at in times.items():
                channels[name].append(at - changed)
    print("first heard:", summary(first), dict(firsts_by))
    print("by gossip:  ", summary(channels["gossip"]))
    print("by fetch:   ", summary(channels["fetch"]))
    print("fetch took: ", summary(fetch_took))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
