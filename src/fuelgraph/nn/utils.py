"""torch.nn.utils' gradient helpers."""
from __future__ import annotations

from ..errors import FuelGraphError
from ..ir.tensor import Tensor, full, stack


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Scale the gradients of `parameters` together so that their total norm is at most
    `max_norm` (torch's rule: factor min(1, max_norm / (norm + 1e-6))). Returns the total norm
    (a lazy 0-d tensor: inside a traced step it stays part of the step's graph)."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    ps = [p for p in parameters if p.grad is not None]
    if not ps:
        return full((), 0.0)
    if error_if_nonfinite:
        raise FuelGraphError("clip_grad_norm_: error_if_nonfinite needs a host check; clip "
                             "first and test the returned norm with .isfinite()")
    norm_type = float(norm_type)
    per = [p.grad.astype(p.grad.dtype.acc).norm(norm_type) for p in ps]
    total = stack(per).norm(norm_type) if len(per) > 1 else per[0]
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in ps:
        p.grad = (p.grad * scale.astype(p.grad.dtype)).astype(p.grad.dtype)
    return total
