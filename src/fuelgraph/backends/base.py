"""One kernel table for every backend, keyed by (op identity, backend). The identity of a
primitive is its op class name ("Binary", "Reduce", ...); of a fused op, its integer id.
Kernels register where they are written, with the `kernel` decorator; each declares the float
dtypes it takes, the shapes/params it covers (`supports`), a cost estimate and its precision.
A fused-op call that no kernel covers is lowered to the op's recipe by the optimizer."""
from __future__ import annotations

import ast
import importlib
import math
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..ir import ops


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def time(self, flops_per_s=5e10, bytes_per_s=1e10) -> float:
        return max(self.flops / flops_per_s, self.bytes / bytes_per_s)


def elementwise_cost(shapes, params=None, itemsize=4, flops_per_elem=1) -> Cost:
    n = sum(math.prod(s) for s in shapes)
    return Cost(flops_per_elem * n, itemsize * 2 * n)


def row_cost(flops_per_elem: float, itemsize: int = 4) -> Callable:
    """Cost of a row-wise op reading and writing each element once."""
    def cost(shapes, params=None):
        n = sum(math.prod(s) for s in shapes)
        return Cost(flops_per_elem * n, itemsize * 2 * n)
    return cost


@dataclass(frozen=True)
class BackendImpl:
    """kernel(*arrays, **params) -> array or tuple of arrays."""
    kernel: Callable
    dtypes: tuple | None = None            # float dtypes it takes (None: any)
    cost: Callable = elementwise_cost      # (input shapes, params) -> Cost
    precision: str = "acc(T)"              # how it accumulates, for reports
    strided_input: bool = False            # True: takes non-contiguous inputs
    takes_out: bool = False                # destructive kernels: accepts out= (a fresh buffer)
    supports: Callable | None = None       # (shapes, dtypes, params) -> bool; None: every call
    workspace: Callable | None = None      # (shapes, dtypes, params) -> scratch bytes it allocates
    asynchronous: bool = False             # returns (handle, outputs): outputs are valid only
    #                                        after handle.wait() (None: already valid)
    revision: int = 1
    name: str = ""


KERNELS: dict[tuple, list[BackendImpl]] = {}


def register_kernel(identity, backend: str, kernel: Callable, **kw) -> BackendImpl:
    """Add `kernel` to the table. identity: a primitive op class name or a fused-op id."""
    impl = BackendImpl(kernel, **kw)
    key = (identity if isinstance(identity, str) else int(identity), backend)
    KERNELS.setdefault(key, []).append(impl)
    return impl


def kernel(identity, backend: str, *, dtypes=None, cost=elementwise_cost, precision="acc(T)",
           strided_input=False, supports=None, workspace=None, asynchronous=False, name=None):
    """Decorator: register the decorated function as `backend`'s kernel for `identity` (a
    fused-op id or a primitive class name) where the function is written. The kernel takes the
    node's inputs positionally and its params as keywords; a kernel for a destructive op that
    also takes `out=` may be handed a fresh buffer instead of overwriting its input.
    `workspace(shapes, dtypes, params) -> bytes`: scratch memory the kernel allocates while it
    runs, beyond its outputs (for the memory plan; None: none worth counting).
    `asynchronous=True`: the kernel starts work that completes later (a collective in flight)
    and returns `(handle, outputs)`; the plan calls `handle.wait()` (unless None) before the
    first step that reads the outputs, and at the end of the run."""
    def deco(fn):
        import inspect
        register_kernel(identity, backend, fn, dtypes=dtypes, cost=cost, precision=precision,
                        strided_input=strided_input, supports=supports, workspace=workspace,
                        asynchronous=asynchronous,
                        takes_out="out" in inspect.signature(fn).parameters,
                        name=name or f"{backend}.{fn.__name__}")
        return fn
    return deco


#: (registry family, backend) -> factory(entry) building the kernel of a run-time entry
KERNEL_FACTORIES: dict[tuple[str, str], Callable] = {}


def kernel_factory(family: str, backend: str):
    """Decorator: `fn(entry)` builds `backend`'s kernel for a run-time fused op of registry
    family `family` (an entry registered at run time, e.g. a generated glue region) the first
    time a kernel for it is looked up. It returns `register_kernel`'s keywords as a dict (with
    `kernel`), or None when this backend has no kernel for that entry (it then runs as its
    recipe)."""
    def deco(fn):
        KERNEL_FACTORIES[(family, backend)] = fn
        return fn
    return deco


def import_kernel_modules(package: str) -> None:
    """Import every module of `package` so that their `@kernel` declarations run."""
    pkg = importlib.import_module(package)
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{m.name}")


def declared_kernels(package_dir: Path, backend: str) -> dict[str, str]:
    """{FusedOps attribute or module constant named in `@kernel(X, backend, ...)`: function
    name}, read from the sources of `package_dir` without importing them (so a machine
    without the backend's dependencies can still list what it would provide)."""
    out = {}
    for path in sorted(Path(package_dir).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "kernel"
                        and len(d.args) >= 2 and isinstance(d.args[1], ast.Constant)
                        and d.args[1].value == backend):
                    target = d.args[0]
                    label = target.attr if isinstance(target, ast.Attribute) else \
                        getattr(target, "id", ast.unparse(target))
                    out[label] = node.name
    return out


def accepts(k: BackendImpl, dtypes, shapes=None, params=None) -> bool:
    """A kernel's dtype list constrains its float inputs (index inputs are always allowed);
    its `supports` predicate, when given shapes, decides the rest."""
    if k.dtypes is not None and not all(d in k.dtypes for d in dtypes if d.is_float):
        return False
    return k.supports is None or shapes is None or bool(k.supports(shapes, dtypes, params))


def scan_loop(op, args, alloc, run_body) -> tuple:
    """The Scan primitive on any backend: loop over t running the body through `run_body(args)`
    (the planner binds it to the body's cached plan); `alloc(shape, dtype)` makes the stacked
    ys buffers."""
    nc, nx = op.n_carry, op.n_xs
    carries, xs, consts = list(args[:nc]), args[nc:nc + nx], list(args[nc + nx:])
    ys = [alloc((op.length,) + y.shape, y.dtype) for y in op.body.outputs[nc:]]
    steps = range(op.length - 1, -1, -1) if op.reverse else range(op.length)
    for t in steps:
        outs = run_body(carries + [x[t] for x in xs] + consts)
        carries = list(outs[:nc])
        for buf, y in zip(ys, outs[nc:]):
            buf[t] = y
    return tuple(carries) + tuple(ys)


def op_identity(op):
    return int(op.id) if isinstance(op, ops.Fused) else type(op).__name__
