"""Where an all-reduce round's time goes: a summary of the peers' merged timelines
(``AllReduceTrace`` events and interface byte counters, see ``tests/netlab/peer.py``), for
``benchmark_wan.py --trace``. Pure functions over the JSON the peers report."""

from __future__ import annotations

import itertools
import statistics


def _median(values) -> float | None:
    values = list(values)
    return round(statistics.median(values), 3) if values else None


def link_busy(link: list[list[float]], mbit: float, start: float, end: float) -> dict:
    """From ``[time, rx_bytes, tx_bytes]`` samples: bytes sent and received in [start, end]
    and the share of that span each direction ran at >= 80% of ``mbit`` (L2 bytes)."""
    rows = [r for r in link if start - 0.05 <= r[0] <= end + 0.05]
    if len(rows) < 2:
        return {}
    full = 0.8 * mbit * 1e6 / 8  # bytes per second
    busy = {"rx": 0.0, "tx": 0.0}
    for (t0, rx0, tx0), (t1, rx1, tx1) in itertools.pairwise(rows):
        dt = t1 - t0
        if dt <= 0:
            continue
        busy["rx"] += dt if (rx1 - rx0) / dt >= full else 0.0
        busy["tx"] += dt if (tx1 - tx0) / dt >= full else 0.0
    span = rows[-1][0] - rows[0][0]
    return {
        "tx_mib": round((rows[-1][2] - rows[0][2]) / 2**20, 2),
        "rx_mib": round((rows[-1][1] - rows[0][1]) / 2**20, 2),
        "tx_busy_share": round(busy["tx"] / span, 2) if span else None,
        "rx_busy_share": round(busy["rx"] / span, 2) if span else None,
    }


def summarize_round(peer_rounds: list[dict], mbit: float) -> dict:
    """``peer_rounds``: one traced round per peer (``trace`` events, ``link`` samples).

    Times are seconds after the first ``round_began`` of any peer. Per peer (by group
    index): when its parts were all written and reduced, when its last delta arrived, its
    link's busy shares; for the group: how long reducers waited between the first and the
    last sender's copy of a part (``reduce_wait``), and per flow (sender -> reducer) the
    parts' and deltas' spans."""
    by_index: dict[int, dict] = {}
    for round_ in peer_rounds:
        events = round_.get("trace") or []
        began = [e for e in events if e["kind"] == "round_began"]
        if began:
            by_index[began[0]["peer"]] = round_
    if not by_index:
        return {}
    t0 = min(e["time"] for r in by_index.values() for e in r["trace"] if e["kind"] == "round_began")
    t_end = max(e["time"] for r in by_index.values() for e in r["trace"])

    def rel(t: float) -> float:
        return round(t - t0, 3)

    peers, waits, flows = {}, [], {}
    for me, round_ in sorted(by_index.items()):
        events = round_["trace"]
        kinds: dict[str, list[dict]] = {}
        for e in events:
            kinds.setdefault(e["kind"], []).append(e)
        received: dict[int, list[float]] = {}
        for e in kinds.get("part_received", []):
            received.setdefault(e["part"], []).append(e["time"])
        for stamps in received.values():
            waits.append(max(stamps) - min(stamps))
        for e in kinds.get("part_written", []):
            flow = flows.setdefault((me, e["peer"]), {"part_bytes": 0, "written": []})
            flow["part_bytes"] += e["nbytes"]
            flow["written"].append(e["time"])
        for e in kinds.get("part_queued", []):
            flows.setdefault((me, e["peer"]), {"part_bytes": 0, "written": []}).setdefault(
                "queued", []
            ).append(e["time"])
        for e in kinds.get("part_received", []):
            flows.setdefault((e["peer"], me), {"part_bytes": 0, "written": []}).setdefault(
                "received", []
            ).append(e["time"])
        for e in kinds.get("delta_received", []):
            flows.setdefault((me, e["peer"]), {"part_bytes": 0, "written": []}).setdefault(
                "delta_received", []
            ).append(e["time"])
        for e in kinds.get("delta_queued", []):
            flows.setdefault((e["peer"], me), {"part_bytes": 0, "written": []}).setdefault(
                "delta_queued", []
            ).append(e["time"])
        began = kinds["round_began"][0]["time"]
        ended = kinds.get("round_ended", [{"time": t_end}])[0]["time"]
        reduced = [e["time"] for e in kinds.get("part_reduced", [])]
        written = [e["time"] for e in kinds.get("part_written", [])]
        deltas_in = [e["time"] for e in kinds.get("delta_received", [])]
        deltas_out = [e["time"] for e in kinds.get("delta_written", [])]
        peers[me] = {
            "began": rel(began),
            "parts_written": rel(max(written)) if written else None,
            "first_part_reduced": rel(min(reduced)) if reduced else None,
            "last_part_reduced": rel(max(reduced)) if reduced else None,
            "last_delta_written": rel(max(deltas_out)) if deltas_out else None,
            "last_delta_received": rel(max(deltas_in)) if deltas_in else None,
            "ended": rel(ended),
            **link_busy(round_.get("link") or [], mbit, began, ended),
        }
        lanes = round_.get("lanes") or {}
        if lanes:
            peers[me]["lanes_opened_fallbacks"] = [lanes["lanes_opened"], lanes["lane_fallbacks"]]
    flow_rows = {}
    for (sender, reducer), flow in sorted(flows.items()):
        queued, received = flow.get("queued", []), flow.get("received", [])
        d_queued, d_received = flow.get("delta_queued", []), flow.get("delta_received", [])
        row = {}
        if queued and received:
            span = max(received) - min(queued)
            row["parts"] = [rel(min(queued)), rel(max(received))]
            if span > 0 and flow["part_bytes"]:
                row["parts_mbit"] = round(flow["part_bytes"] * 8 / span / 1e6, 1)
        if d_queued and d_received:
            row["deltas"] = [rel(min(d_queued)), rel(max(d_received))]
        flow_rows[f"{sender}->{reducer}"] = row
    return {
        "span": rel(t_end),
        "peers": peers,
        "reduce_wait_median": _median(waits),
        "reduce_wait_max": round(max(waits), 3) if waits else None,
        "flows": flow_rows,
    }
