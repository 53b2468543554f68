"""Small model builders written in primitives (the optimizer fuses their idioms)."""
from .kv_cache import PagedKVCache
from .transformer import TinyBlock

__all__ = ["PagedKVCache", "TinyBlock"]
