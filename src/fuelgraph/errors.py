"""Errors raised by fuelgraph. Every invalid call raises `FuelGraphError` at graph-build time."""


class FuelGraphError(Exception):
    """Invalid graph, op, shape, dtype or parameter. The message names the op, the input and
    what was expected."""


def fail(op: str, what: str) -> "FuelGraphError":
    """Build a FuelGraphError with the conventional `op: message` prefix."""
    return FuelGraphError(f"{op}: {what}")
