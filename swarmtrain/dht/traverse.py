"""Parallel beam search over the DHT graph; the network is an injected ``get_neighbors`` coroutine.

A node is *returned* as one of the nearest only after it answered a ``get_neighbors`` call, so
unresponsive peers never make it into the results. ``get_neighbors`` signals an unresponsive peer
by returning None; any exception it raises is treated as a bug and propagates (cancelling the
search) as an exception group.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Mapping
from typing import Any

import anyio
import anyio.abc

from .identifiers import DHTID

__all__ = ["FoundCallback", "GetNeighbors", "simple_traverse_dht", "traverse_dht"]

#: ``await get_neighbors(peer, queries)`` -> {query: (neighbors of query known to peer,
#: should_stop)}, or None if the peer did not answer. Queries missing from the mapping are
#: treated as answered with no neighbors.
GetNeighbors = Callable[
    [DHTID, list[DHTID]], Awaitable[Mapping[DHTID, tuple[Collection[DHTID], bool]] | None]
]
#: ``await found_callback(query, nearest_nodes, visited_nodes)`` once per query, when it finishes.
FoundCallback = Callable[[DHTID, list[DHTID], set[DHTID]], Coroutine[Any, Any, Any]]


def _check_positive(**kwargs: int) -> None:
    for name, value in kwargs.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")


class _QueryState:
    """Search state of one query: candidate heap (nearest first) and beam of answered nodes."""

    __slots__ = ("active", "beam", "candidates", "in_flight", "known", "query", "visited")

    def __init__(
        self,
        query: DHTID,
        initial_nodes: list[DHTID],
        visited: Iterable[DHTID],
        answered: Iterable[DHTID] = (),
        beam_size: int = 1,
    ):
        self.query = query
        answered = list(dict.fromkeys(answered))
        self.visited: set[DHTID] = set(visited) | set(answered)
        self.known: set[DHTID] = set(initial_nodes) | set(answered)
        self.candidates = [(query ^ node, node) for node in self.known if node not in self.visited]
        heapq.heapify(self.candidates)
        self.beam: list[tuple[int, DHTID]] = []  # (-distance, node): farthest answered on top
        for node in answered:
            self.add_answer(node, (), beam_size)
        self.active = 0  # get_neighbors calls in flight that include this query
        # node called for this query -> (its distance, when the call started)
        self.in_flight: dict[DHTID, tuple[int, float]] = {}

    def upper_bound(self, beam_size: int) -> float:
        return -self.beam[0][0] if len(self.beam) >= beam_size else math.inf

    def optimistic_bound(self, beam_size: int, now: float, patience: float) -> float:
        """The ``beam_size``-th distance among answered nodes and nodes whose call is in flight
        for less than ``patience`` seconds.

        A candidate at least that far would not enter the beam if those calls succeed, so it
        waits for them; once none is in flight this equals :meth:`upper_bound`.
        """
        pending = [d for d, started in self.in_flight.values() if now - started < patience]
        if not pending:
            return self.upper_bound(beam_size)
        if len(self.beam) + len(pending) < beam_size:
            return math.inf
        distances = [-distance for distance, _ in self.beam]
        distances.extend(pending)
        return heapq.nsmallest(beam_size, distances)[-1]

    def next_candidate_distance(
        self, beam_size: int, failed: set[DHTID], bound: float | None = None
    ) -> float:
        """Distance of the nearest candidate worth visiting (inf if none); drops stale entries.

        :param bound: visit only candidates nearer than this (default: :meth:`upper_bound`)
        """
        while self.candidates and (
            self.candidates[0][1] in self.visited or self.candidates[0][1] in failed
        ):
            heapq.heappop(self.candidates)
        if bound is None:
            bound = self.upper_bound(beam_size)
        if self.candidates and self.candidates[0][0] < bound:
            return self.candidates[0][0]
        return math.inf

    def add_answer(self, peer: DHTID, neighbors: Iterable[DHTID], beam_size: int) -> None:
        distance = self.query ^ peer
        if len(self.beam) < beam_size:
            heapq.heappush(self.beam, (-distance, peer))
        elif distance < -self.beam[0][0]:
            heapq.heapreplace(self.beam, (-distance, peer))
        bound = self.upper_bound(beam_size)
        for neighbor in neighbors:
            if neighbor not in self.known:
                self.known.add(neighbor)
                distance = self.query ^ neighbor
                if distance < bound and neighbor not in self.visited:
                    heapq.heappush(self.candidates, (distance, neighbor))

    def nearest(self) -> list[DHTID]:
        return [node for _, node in sorted(self.beam, reverse=True)]


class _Search:
    def __init__(
        self,
        queries: list[DHTID],
        initial_nodes: list[DHTID],
        beam_size: int,
        queries_per_call: int,
        get_neighbors: GetNeighbors,
        visited_nodes: Mapping[DHTID, Collection[DHTID]],
        answered_nodes: Mapping[DHTID, Collection[DHTID]],
        found_callback: FoundCallback | None,
        patience: float,
    ):
        self.beam_size, self.queries_per_call = beam_size, queries_per_call
        self.patience = patience
        self.get_neighbors, self.found_callback = get_neighbors, found_callback
        self.states = {
            q: _QueryState(
                q, initial_nodes, visited_nodes.get(q, ()), answered_nodes.get(q, ()), beam_size
            )
            for q in queries
        }
        self.unfinished: dict[DHTID, _QueryState] = dict(self.states)
        self.failed: set[DHTID] = set()
        self._updated = anyio.Event()
        self._workers_scope: anyio.CancelScope | None = None
        self._callbacks: anyio.abc.TaskGroup | None = None

    async def run(self, num_workers: int, callbacks: anyio.abc.TaskGroup | None) -> None:
        self._callbacks = callbacks
        async with anyio.create_task_group() as workers:
            self._workers_scope = workers.cancel_scope
            for _ in range(num_workers):
                workers.start_soon(self._worker)

    def _notify(self) -> None:
        self._updated.set()
        self._updated = anyio.Event()

    def _finish(self, state: _QueryState) -> None:
        del self.unfinished[state.query]
        if self._callbacks is not None and self.found_callback is not None:
            self._callbacks.start_soon(
                self.found_callback, state.query, state.nearest(), set(state.visited)
            )
        if not self.unfinished and self._workers_scope is not None:
            self._workers_scope.cancel()  # abort get_neighbors calls still in flight
        self._notify()

    def _choose(self) -> _QueryState | None:
        """Finish exhausted queries, then pick the query to expand: fewest calls, then nearest."""
        best, best_priority = None, (math.inf, math.inf)
        now = anyio.current_time()
        for state in list(self.unfinished.values()):
            bound = state.optimistic_bound(self.beam_size, now, self.patience)
            distance = state.next_candidate_distance(self.beam_size, self.failed, bound)
            if distance == math.inf:
                if state.active == 0:
                    self._finish(state)
                continue
            if (state.active, distance) < best_priority:
                best, best_priority = state, (state.active, distance)
        return best

    def _time_until_a_call_turns_slow(self) -> float:
        """Seconds until a call in flight stops holding back farther candidates (or inf)."""
        now, deadline = anyio.current_time(), math.inf
        for state in self.unfinished.values():
            for _, started in state.in_flight.values():
                if now - started < self.patience:
                    deadline = min(deadline, started + self.patience)
        return max(0.0, deadline - now)

    async def _worker(self) -> None:
        while self.unfinished:
            state = self._choose()
            if state is None:
                if self.unfinished:  # some call is in flight and may bring new candidates
                    with anyio.move_on_after(self._time_until_a_call_turns_slow()):
                        await self._updated.wait()
                continue
            _, peer = heapq.heappop(state.candidates)
            others = [
                s for s in self.unfinished.values() if s is not state and peer not in s.visited
            ]
            batch = [
                state,
                *heapq.nsmallest(self.queries_per_call - 1, others, key=lambda s: s.query ^ peer),
            ]
            started = anyio.current_time()
            for member in batch:
                member.visited.add(peer)
                member.active += 1
                member.in_flight[peer] = (member.query ^ peer, started)
            try:
                response = await self.get_neighbors(peer, [member.query for member in batch])
            finally:
                for member in batch:
                    member.active -= 1
                    del member.in_flight[peer]
                self._notify()
            if response is None:
                self.failed.add(peer)
                continue
            for member in batch:
                if member.query not in self.unfinished:
                    continue  # finished by another worker while we awaited
                neighbors, should_stop = response.get(member.query, ((), False))
                member.add_answer(peer, neighbors, self.beam_size)
                if should_stop:
                    self._finish(member)
            self._notify()


async def traverse_dht(
    queries: Collection[DHTID],
    initial_nodes: Collection[DHTID],
    beam_size: int,
    num_workers: int,
    queries_per_call: int,
    get_neighbors: GetNeighbors,
    visited_nodes: Mapping[DHTID, Collection[DHTID]] | None = None,
    found_callback: FoundCallback | None = None,
    callback_task_group: anyio.abc.TaskGroup | None = None,
    answered_nodes: Mapping[DHTID, Collection[DHTID]] | None = None,
    patience: float = math.inf,
) -> tuple[dict[DHTID, list[DHTID]], dict[DHTID, set[DHTID]]]:
    """Find the ``beam_size`` answering nodes nearest to each query, with concurrent workers.

    Each of ``num_workers`` workers repeatedly expands the nearest unvisited candidate of the
    query with the fewest calls in flight, asking that peer about up to ``queries_per_call``
    unfinished queries at once (the chosen one plus those nearest to the peer). A query finishes
    when ``get_neighbors`` says ``should_stop`` for it, or when no candidate nearer than its
    ``beam_size``-th answered node is left and none of its calls is in flight.

    A candidate is called only if it is nearer than the ``beam_size``-th of the answered nodes
    *and the nodes whose calls are in flight* (for less than ``patience`` seconds): while
    nearer calls may still fill the beam, farther candidates wait; they are called if those
    calls fail or turn slow. So a search calls few nodes beyond the ``beam_size`` nearest, at
    the price of some parallelism near its end.

    :param visited_nodes: per query, nodes never to call nor return (e.g. already asked)
    :param answered_nodes: per query, nodes that count as answered without a call: they take
      a place in the beam (and are returned) but are never called, e.g. the searching node
      itself, whose own answer the caller already has
    :param patience: seconds a call in flight holds back farther candidates (default: until
      it ends)
    :param found_callback: started once per query as soon as that query finishes, with
      ``(query, nearest_nodes, visited_nodes)``
    :param callback_task_group: where ``found_callback`` runs. If None (default), callbacks run
      in a task group of this call and are awaited before returning (hivemind's
      ``await_all_tasks=True``); pass the caller's task group to return without waiting for them.
    :returns: ({query: nearest answered nodes, nearest first}, {query: nodes called for it})

    Resource handling: every task runs in a task group of this call or in
    ``callback_task_group``; ``get_neighbors`` calls still in flight when the search finishes
    are cancelled. Cancelling this call cancels all of its tasks.
    """
    _check_positive(beam_size=beam_size, num_workers=num_workers, queries_per_call=queries_per_call)
    unique_queries = list(dict.fromkeys(queries))
    search = _Search(
        unique_queries,
        list(dict.fromkeys(initial_nodes)),
        beam_size,
        queries_per_call,
        get_neighbors,
        visited_nodes or {},
        answered_nodes or {},
        found_callback,
        patience,
    )
    if found_callback is None or callback_task_group is not None:
        await search.run(num_workers, callback_task_group)
    else:
        async with anyio.create_task_group() as callbacks:
            await search.run(num_workers, callbacks)
    nearest = {q: search.states[q].nearest() for q in unique_queries}
    visited = {q: set(search.states[q].visited) for q in unique_queries}
    return nearest, visited


async def simple_traverse_dht(
    query_id: DHTID,
    initial_nodes: Collection[DHTID],
    beam_size: int,
    get_neighbors: Callable[[DHTID], Awaitable[tuple[Collection[DHTID], bool] | None]],
    visited_nodes: Collection[DHTID] = (),
) -> tuple[list[DHTID], set[DHTID]]:
    """Sequential reference version of :func:`traverse_dht` for one query and one worker.

    ``await get_neighbors(peer)`` returns ``(neighbors, should_stop)``, or None if the peer did
    not answer. Returns the nearest answered nodes (nearest first) and all visited nodes.
    """
    _check_positive(beam_size=beam_size)
    state = _QueryState(query_id, list(dict.fromkeys(initial_nodes)), visited_nodes)
    failed: set[DHTID] = set()
    while state.next_candidate_distance(beam_size, failed) < math.inf:
        _, peer = heapq.heappop(state.candidates)
        state.visited.add(peer)
        response = await get_neighbors(peer)
        if response is None:
            failed.add(peer)
            continue
        neighbors, should_stop = response
        state.add_answer(peer, neighbors, beam_size)
        if should_stop:
            break
    return state.nearest(), set(state.visited)
