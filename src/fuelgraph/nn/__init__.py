"""Small model builders written in primitives (the optimizer fuses their idioms)."""
from .transformer import TinyBlock

__all__ = ["TinyBlock"]
