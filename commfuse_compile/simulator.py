"""A small event-driven timeline: lanes that run their events in issue order, and dependencies.

Each lane (the compute stream, the link to each ring neighbour, the collective stream) runs
one event at a time, in the order the events were added (program order). An event starts when
its lane is free and every event it depends on has ended. That is all the cost model needs to
time a schedule; the resulting events are also what a trace viewer shows.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Event:
    name: str
    lane: str
    duration: float
    deps: tuple[int, ...] = ()
    start: float = 0.0
    end: float = 0.0


@dataclasses.dataclass
class Timeline:
    events: list[Event] = dataclasses.field(default_factory=list)

    def add(self, name: str, lane: str, duration: float, deps: tuple[int | None, ...] = ()) -> int:
        """Append an event (program order); returns its id for later ``deps``. ``None`` deps are dropped."""
        self.events.append(Event(name, lane, duration, tuple(d for d in deps if d is not None)))
        return len(self.events) - 1

    def run(self) -> float:
        """Schedule every event; return the makespan (seconds)."""
        lane_free: dict[str, float] = {}
        for event in self.events:  # deps always point backwards: one pass suffices
            ready = max((self.events[d].end for d in event.deps), default=0.0)
            event.start = max(ready, lane_free.get(event.lane, 0.0))
            event.end = event.start + event.duration
            lane_free[event.lane] = event.end
        return max((e.end for e in self.events), default=0.0)

    def busy(self, lane_prefix: str) -> float:
        """Total duration of the events on lanes whose name starts with ``lane_prefix``."""
        return sum(e.duration for e in self.events if e.lane.startswith(lane_prefix))
