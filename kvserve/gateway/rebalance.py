"""Moving a held session off a backend whose queue has grown far past the others'. Sessions are placed by count
(bounded load), but sessions are not alike: a few very active ones (an agent firing requests in parallel) can
land together and queue one backend while the rest idle. Then the session is moved to the shortest queue: the move
costs one cache miss (its history is prefilled again there), so it is made only when the gap is large (over
`ratio` x the mean queue, the target under the mean) and the backend is busy enough for a miss to be worth it,
and only when the target, with the moved request, stays shorter than the backend left: the same session is
never moved straight back.

A backend's queue is what the gateway knows freshest: its own requests in flight there, or the backend's
running + waiting from its last /metrics when that is more (other replicas' requests)."""

from __future__ import annotations

from kvserve.gateway.backends import Backend


def rebalance_target(current: Backend, candidates: list[Backend], ratio: float, min_queue: int) -> Backend | None:
    """The backend a session held by `current` should move to now, or None to stay. `candidates` includes
    `current`; `ratio` 0 disables moving for load."""
    if ratio <= 0 or len(candidates) < 2:
        return None
    queues = {backend.url: backend.queue_length() for backend in candidates}
    mean = sum(queues.values()) / len(queues)
    here = queues[current.url]
    if here < min_queue or here <= ratio * mean:
        return None
    target = min((b for b in candidates if b is not current), key=lambda b: queues[b.url])
    if queues[target.url] >= mean or queues[target.url] + 1 >= here - 1:
        return None
    return target
