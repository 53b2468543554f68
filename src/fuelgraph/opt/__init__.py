"""Optimizer: canonicalize, fuse, lower (CSE/DCE are structural); see passes.optimize."""
from .engine import Pass, RewriteLog, run_pass
from .passes import OptResult, optimize

__all__ = ["Pass", "RewriteLog", "run_pass", "OptResult", "optimize"]
