"""The open registry of fused ops."""
from .core import (BackwardKind, FusedOpEntry, FusedOpId, FusedOpRegistry, FusedOps, NoParams,
                   call_fused, default_registry)

__all__ = ["BackwardKind", "FusedOpEntry", "FusedOpId", "FusedOpRegistry", "FusedOps", "NoParams",
           "call_fused", "default_registry"]
