"""The built-in op families; each module declares its entries with `declare(registry)`."""
from __future__ import annotations


def declare_all(reg):
    from . import affine, helpers, linear, loss, norm, rope, softmax
    for family in (softmax, helpers, norm, rope, linear, loss, affine):
        family.declare(reg)
