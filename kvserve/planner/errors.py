"""The one exception the planner raises for bad input."""

from __future__ import annotations


class PlannerError(ValueError):
    """Bad planner input: an unknown model or GPU, a TP size that does not divide the heads, a negative size...

    The message is written for the person at the command line: it names the bad value and, where there is one,
    what would be accepted instead (close model ids, catalog GPUs, valid TP sizes).
    """
