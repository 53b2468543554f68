"""The built-in op families; each module declares its entries with `declare(registry)`."""
from __future__ import annotations


def declare_all(reg):
    from . import helpers, softmax
    for family in (softmax, helpers):
        family.declare(reg)
