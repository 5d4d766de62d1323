"""Summarize the loop-stall lines of logs (``SWARMTRAIN_LOOP_STALLS=0.1``): per kind and task.

    SWARMTRAIN_LOOP_STALLS=0.1 python benchmarks/benchmark_optimizer.py ... --verbose 2> run.log
    python benchmarks/loop_stall_summary.py run.log [more.log ...]

Prints the count, max and p99 of all stalls, then per kind (gc / starved / blocking) and per
task and place (the sampled frame), largest total first.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

LINE = re.compile(
    r"trio loop stalled (?P<ms>\d+) ms \((?P<kind>\w+): cpu (?P<cpu>\d+) ms, gc (?P<gc>\d+) ms"
    r"(?:, run queue (?P<runqueue>[\d?]+)(?: ms)?)?(?P<extra>[^)]*)\)"
    r" in task '(?P<task>[^']*)', from (?P<start>.*?) to (?P<end>.*?); at (?P<at>.*)$"
)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def row(name: str, group: list[dict]) -> str:
    walls = [float(s["ms"]) for s in group]
    cpus = [float(s["cpu"]) for s in group]
    queued = [float(s["runqueue"]) for s in group if (s.get("runqueue") or "?") != "?"]
    runqueue = f"{statistics.median(queued):.0f}" if queued else "?"
    return (
        f"| {name} | {len(walls)} | {max(walls):.0f} | {quantile(walls, 0.99):.0f} | "
        f"{statistics.median(walls):.0f} | {statistics.median(cpus):.0f} | {runqueue} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    stalls = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            for line in f:
                match = LINE.search(line)
                if match:
                    stalls.append(match.groupdict())
    if not stalls:
        print("no stalls")
        return
    head = "| count | max ms | p99 ms | median ms | median cpu ms | median run queue ms |"
    print("| stalls " + head)
    print("|---" * 7 + "|")
    print(row("all", stalls))
    by: dict[str, list[dict]] = defaultdict(list)
    for stall in stalls:
        by[stall["kind"]].append(stall)
    for kind, group in sorted(by.items()):
        print(row(kind, group))
    places: dict[str, list[dict]] = defaultdict(list)
    for stall in stalls:
        task = stall["task"].rsplit(".", 2)
        places[f"{stall['kind']}: {'.'.join(task[-2:])} @ {stall['at']}"].append(stall)
    print()
    print("| kind: task @ place " + head)
    print("|---" * 7 + "|")
    ranked = sorted(places.items(), key=lambda kv: -sum(float(s["ms"]) for s in kv[1]))
    for name, group in ranked[: args.top]:
        print(row(name, group))


if __name__ == "__main__":
    main()
