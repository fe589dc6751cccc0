"""The schedules as pure functions: which piece each step computes, sends and receives.

One definition serves the rewrite (which emits exactly these steps) and the cost model (which
times exactly these steps), so the two cannot drift apart.

Pieces. The gathered / scattered tensor is cut along its dim into N chunks (chunk j is rank j's)
of P pieces each; piece ``q = j·P + p`` is piece p of chunk j. Each of a rank's P *streams*
(one per piece of its chunk) travels the ring on its own: the one-way ring has P = m streams
moving to r + 1; the bidirectional ring has P = 2m, streams m..2m-1 moving to r − 1. A step of
the ring is m *sub-steps*; the moves of one sub-step (one stream, or one per direction) start
together, compute, then wait.

Flash-AG (rank r, step k = 0 .. N-1): stream (p, d) holds chunk (r − d·k) mod N, computes its
piece, and — unless k = N − 1 — sends it on to r + d while receiving the next from r − d::

    for k in range(N):
        for sub in substeps:                       # [(p, d), ...]
            start  send(cur[p], r + d), recv(r - d)     (k < N-1)
            compute piece ((r - d·k) % N)·P + p         (overlaps the transfer)
            wait                                        (k < N-1)

Flash-RS (rank r, step i = 0 .. N-1): stream (p, d) computes the partial of chunk
(r − d·(1 + i)) mod N, adds the accumulator received from r − d (i > 0), and sends it on to
r + d (i < N − 1); the last step's chunk is r itself: no tail.

Flash-All-to-All (rank r, step k = 1 .. N-1): send block r + k, receive block r − k.
"""

from __future__ import annotations

import dataclasses

RING_SCHEDULES = ("ring", "bidirectional")


@dataclasses.dataclass(frozen=True)
class Move:
    """One stream's part of one ring step on one rank (group ranks throughout)."""

    stream: int  # p: which piece of the rank's chunk travels in this stream
    direction: int  # +1: to r + 1, from r − 1; −1: the other way
    piece: int  # q: the piece of the tensor computed at this step
    send_to: int
    recv_from: int
    sends: bool  # Flash-AG: the held piece goes on; Flash-RS: the new partial goes on
    receives: bool  # Flash-AG: the next piece arrives; Flash-RS: an accumulator arrives


def substeps(schedule: str, m: int) -> list[list[tuple[int, int]]]:
    """The sub-steps of one ring step: the (stream, direction) pairs that move together.
    One-way: m streams, one per sub-step. Bidirectional: 2m; sub-step s moves stream s to
    r + 1 and stream m + s to r − 1."""
    if schedule == "bidirectional":
        return [[(s, +1), (m + s, -1)] for s in range(m)]
    return [[(s, +1)] for s in range(m)]


def pieces_per_chunk(schedule: str, m: int) -> int:
    """How many pieces each rank's chunk is cut into (slicing: m slices)."""
    return 2 * m if schedule == "bidirectional" else m


def flash_ag_steps(n: int, r: int, schedule: str, m: int) -> list[list[list[Move]]]:
    """Flash-AG on rank r of n: steps → sub-steps → moves."""
    per_chunk = pieces_per_chunk(schedule, m)
    last = n - 1
    return [
        [
            [Move(p, d, ((r - d * k) % n) * per_chunk + p, (r + d) % n, (r - d) % n, sends=k < last, receives=k < last) for p, d in sub]
            for sub in substeps(schedule, m)
        ]
        for k in range(n)
    ]


def flash_rs_steps(n: int, r: int, schedule: str, m: int) -> list[list[list[Move]]]:
    """Flash-RS on rank r of n: steps → sub-steps → moves."""
    per_chunk = pieces_per_chunk(schedule, m)
    last = n - 1
    return [
        [
            [Move(p, d, ((r - d * (1 + i)) % n) * per_chunk + p, (r + d) % n, (r - d) % n, sends=i < last, receives=i > 0) for p, d in sub]
            for sub in substeps(schedule, m)
        ]
        for i in range(n)
    ]


def slice_pieces(n: int, k: int, s: int) -> list[int]:
    """Slicing with k slices: the pieces slice s carries (piece s of every rank's chunk)."""
    return [j * k + s for j in range(n)]


def all_to_all_steps(n: int, r: int) -> list[Move]:
    """Flash-All-to-All on rank r of n: step k = 1 .. n-1 sends block r + k of the input to rank
    r + k and receives block r − k of the result from rank r − k (every rank shifts by k, so
    each send meets its peer's receive); the own block (k = 0) never travels."""
    return [Move(0, k, (r - k) % n, (r + k) % n, (r - k) % n, sends=True, receives=True) for k in range(1, n)]


@dataclasses.dataclass(frozen=True)
class ExpertStep:
    """One step of the expert-parallel pipeline on rank r (:func:`moe_ep_steps`)."""

    dispatch: Move | None  # send my tokens for r + k's experts there, receive r − k's for mine
    combine: Move | None  # send the experts' results for r − k's tokens back, receive mine from r + k
    experts_on: int | None  # whose tokens (a source rank) the experts run on meanwhile


def moe_ep_steps(n: int, r: int) -> list[ExpertStep]:
    """Dispatch → experts → combine on rank r of n, one source rank's tokens at a time.

    Dispatch step k (k = 1 .. n-1) is Flash-All-to-All's step k; combine step k sends the
    results for r − k's tokens back to r − k and receives this rank's tokens' results from
    r + k (the reverse shift: each send meets its peer's receive). Step i starts dispatch step
    i and combine step i − 2 and runs the experts on the tokens that arrived at step i − 1 (its
    own at step 1: nothing waits on the network first): the results for r − k go back one step
    after they are computed, while the next tokens' experts run. Only the last combine step
    (one block) has nothing to overlap::

        i = 1:      dispatch 1                  experts on r (own tokens)
        i = 2:      dispatch 2                  experts on r − 1
        i = 3:      dispatch 3,  combine 1      experts on r − 2
        ...
        i = n:                   combine n − 2  experts on r − (n − 1)
        i = n + 1:               combine n − 1
    """
    steps = []
    for i in range(1, n + 2):
        dispatch = all_to_all_steps(n, r)[i - 1] if i <= n - 1 else None
        back = i - 2
        combine = Move(0, -back, (r + back) % n, (r - back) % n, (r + back) % n, sends=True, receives=True) if 1 <= back <= n - 1 else None
        steps.append(ExpertStep(dispatch, combine, (r - (i - 1)) % n if i <= n else None))
    return steps
