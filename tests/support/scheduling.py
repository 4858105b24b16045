"""The order pytest-xdist hands tests out in: the costliest kinds first.

xdist gives each worker the next test in collection order as it frees up; a trainer run of
minutes collected last keeps one worker busy while the other idles (9 of the main suite's 36
minutes on the 2-core machine, 2026-12-04). Started first, the long runs overlap and the short
tests fill the gaps. Tests that share a one-per-session run (``validate --quick``) carry an
``xdist_group`` so that one worker runs them all instead of the other waiting on its lock
(``--dist loadgroup``, the Makefile's)."""

# Costliest first: TorchTitan's trainer, then several ranks under torchrun, then the rest.
_COST_MARKERS = ("trainer", "multiprocess")


def _cost_class(item) -> int:
    for rank, name in enumerate(_COST_MARKERS):
        if item.get_closest_marker(name):
            return rank
    return len(_COST_MARKERS)


def costliest_first(items: list) -> None:
    """Sort ``items`` in place, stably: every worker collects the same order, as xdist requires."""
    items.sort(key=_cost_class)
