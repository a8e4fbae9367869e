"""A simulated accelerator for CPU-only runs: finds host tensors handed to NCCL collectives.

On NCCL every tensor given to a collective or point-to-point op must live on the GPU; a host
tensor is refused at run time, so a helper that builds its buffer with ``torch.tensor([...])``
(no device) passes every gloo test and fails on the first GPU run. Inside
:func:`simulated_accelerator` a CPU run behaves, for *where* tensors live, as a GPU run would::

    with simulated_accelerator() as calls:
        x = torch.randn(3).cuda()          # an "accelerator" tensor: x.device == cuda:0
        dist.all_reduce(x)                 # fine
        dist.all_reduce(torch.zeros(3))    # AssertionError: a host tensor (file:line, shape)
    calls                                  # ["all_reduce t.py:4", "all_reduce t.py:5"]

The module is one piece: the tagging, the refusal of mixed calls and the byte count are steps
of one torch-function mode's handling of each call (a tensor is counted when it is tagged), and
the patches of ``torch.distributed`` and autograd exist to keep that mode's tags true.

The data never leaves the CPU (so gloo runs the collectives); a tensor is *tagged* as living on
the accelerator, by an attribute on its Python object:

* ``.to("cuda")``, ``.cuda()``, ``.to(<tagged tensor>)`` and factories with ``device="cuda"``,
  ``device=0`` or ``device=<a tagged tensor's .device>`` make tagged tensors;
* results of ops on tagged tensors are tagged (``new_empty``, ``zeros_like``, views, autograd's
  backward included); an in-place op leaves its target as it was;
* ``.device`` of a tagged tensor is ``cuda:0`` (``is_cuda`` True, ``get_device()`` 0);
* ``.cpu()``, ``.to("cpu")`` give untagged copies; ``.item()``, ``.tolist()`` plain values;
* factories without a device make untagged host tensors, as on a GPU machine;
* ``torch.distributed.get_backend()`` answers ``"nccl"`` and ``torch.cuda.current_device()``
  ``0``, so code that picks its device from the backend picks the accelerator.

The ``torch.distributed`` functions that take tensors (collectives and point-to-point ops, the
``P2POp`` objects of ``batch_isend_irecv`` included) are wrapped: each tensor argument must be
tagged, else an ``AssertionError`` names the function, the calling ``file:line``, the tensor's
shape and dtype. The ``*_object`` variants are not wrapped (they pickle on the host by design).

What a GPU refuses is refused here too:

* an op given both tagged and untagged tensors raises ``RuntimeError`` naming the calling
  ``file:line`` and the host tensor's shape (0-d host tensors are allowed, as CUDA allows
  them; so are the copies between the two: ``copy_``, ``to``, item assignment, ``.data =``,
  and host index tensors in ``t[idx]``);
* a module moved with ``Module.to("cuda")`` / ``.cuda()`` has its parameters tagged (the
  ``.data =`` that ``Module._apply`` does carries the tag), and a parameter's ``.grad`` is
  tagged with it, so :func:`megatron_kd.placement.check_module_device` tells a module that
  kept a host parameter or buffer;
* :func:`megatron_kd.placement.compute_device` answers the accelerator, so the commands move
  their models and batches as on a GPU; ``torch.distributed.is_nccl_available()`` answers
  False (no NCCL group can start without a GPU), so links between processes go over the host.

Memory, as ``torch.cuda``'s allocator statistics count it: the bytes of the storages that
tagged tensors hold, each storage counted once however many views share it, from the moment a
tagged tensor refers to it until the storage itself is freed (a storage kept by autograd for
backward, or as a leaf's ``.grad``, stays counted without any Python tensor of it).
:func:`memory_allocated`, :func:`max_memory_allocated` and :func:`reset_peak_memory_stats`
read it, and so do ``torch.cuda``'s functions of those names inside the ``with`` block. What
runs inside one C++ op (its internal temporaries) is not seen; neither is a storage made by
autograd's C++ engine until a tagged tensor refers to it (a leaf's accumulated ``.grad``: when
it is read). :func:`as_kernel` runs a PyTorch function as one GPU kernel: its temporaries are
not counted (registers and shared memory on a GPU), its results are.

What a GPU runs and the CPU cannot is run here with the same results and memory: a GEMM that
accumulates into a wider output dtype (``torch.addmm(..., out_dtype=torch.float32)`` of bf16
operands) is computed in that dtype, its operands' upcast copies not counted.

Not modelled: there is one device (no ``cuda:1``); the backward pass of
``torch.autograd.grad`` runs untagged (``Tensor.backward`` and ``torch.autograd.backward`` keep
tagging), and so do the gradients autograd's C++ engine hands to hooks registered on plain
tensors (a hook that mixes them with tagged tensors is reported although a GPU would run it;
no hook of ours or Megatron-Core's in the tested paths does). Only this process is affected,
and only inside the ``with`` block; tags left on tensors afterwards change nothing.

``python -m megatron_kd.testing.simulated COMMAND ...`` runs a whole ``megatron-kd`` command
(each torchrun worker) inside it: the CPU tests run the commands' GPU placement that way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.cuda.nccl
import torch.distributed as dist
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

from megatron_kd import placement

__all__ = ["ACCELERATOR", "CHECKED_FUNCTIONS", "as_kernel", "max_memory_allocated",
           "memory_allocated", "on_accelerator", "reset_peak_memory_stats",
           "simulated_accelerator", "to_accelerator"]

#: The device tagged tensors report.
ACCELERATOR = torch.device("cuda", 0)

#: The ``torch.distributed`` functions whose tensor arguments are checked (those present).
CHECKED_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv")

_TAG = "_megatron_kd_on_accelerator"
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_REAL_P2POP = dist.P2POp
_BASE = torch._C.TensorBase
_BACKWARD_SIGNATURES = {f: inspect.signature(f) for f in (torch.Tensor.backward,
                                                         torch.autograd.backward)}
# property getters of a tensor whose answer changes on the accelerator
_GETTERS = {_BASE.__dict__["device"]: ACCELERATOR, _BASE.__dict__["is_cuda"]: True,
            _BASE.__dict__["is_cpu"]: False}
_DATA = _BASE.__dict__["data"]
_GRAD = _BASE.__dict__["grad"]
# calls a GPU runs with a host tensor among device ones: copies between the two, host indices
_MIXING_ALLOWED = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.__setitem__,
                   torch.Tensor.__getitem__, torch.Tensor.set_, torch.Tensor.cpu,
                   torch.Tensor.cuda, torch._has_compatible_shallow_copy_type}


def on_accelerator(t: Any) -> bool:
    """Whether ``t`` is a tensor on the (simulated) accelerator."""
    return isinstance(t, torch.Tensor) and bool(getattr(t, _TAG, False))


class _Memory:
    """The simulated accelerator's allocator statistics: bytes of the storages tagged tensors
    hold, now and at the peak. A storage is keyed by its Python object, which torch keeps for
    as long as the storage lives (so it is one object however many tensors share it), and
    uncounted when that object is finalised, i.e. when the storage is freed."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0
        self.paused = 0
        self._sizes: dict[int, int] = {}  # id(storage object) -> bytes counted

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if it is not counted yet (or count its new size, resized)."""
        if self.paused:
            return
        with torch._C.DisableTorchFunction():
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (sparse, nested)
                return
            nbytes = storage.nbytes()
        key = id(storage)
        counted = self._sizes.get(key)
        if counted is None:
            if nbytes == 0:
                return
            weakref.finalize(storage, self._free, key)
            counted = 0
        self._sizes[key] = nbytes
        self.allocated += nbytes - counted
        self.peak = max(self.peak, self.allocated)

    def _free(self, key: int) -> None:
        self.allocated -= self._sizes.pop(key)


# the counter of the simulation in progress (None outside one)
_memory: _Memory | None = None


def _active_memory() -> _Memory:
    if _memory is None:
        raise RuntimeError("no simulated accelerator: call this inside simulated_accelerator()")
    return _memory


def memory_allocated(device: Any = None) -> int:
    """Bytes of the storages tagged tensors hold now (``torch.cuda.memory_allocated``)."""
    return _active_memory().allocated


def max_memory_allocated(device: Any = None) -> int:
    """The most :func:`memory_allocated` has been since the simulation began or the last
    :func:`reset_peak_memory_stats` (``torch.cuda.max_memory_allocated``)."""
    return _active_memory().peak


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start the peak afresh from what is held now (``torch.cuda.reset_peak_memory_stats``)."""
    memory = _active_memory()
    memory.peak = memory.allocated


def as_kernel(fn: Callable) -> Callable:
    """``fn`` run as one GPU kernel for the memory count: the tensors it makes and frees inside
    are not counted (a kernel keeps them in registers and shared memory), the tensors it
    returns are (also those it wrote in place, already counted). Outside a simulation, ``fn``."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        memory = _memory
        if memory is None:
            return fn(*args, **kwargs)
        memory.paused += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            memory.paused -= 1
        for t in _tensors(out):
            if on_accelerator(t):
                memory.hold(t)
        return out

    return kernel


def _tag(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _TAG, True)
    if _memory is not None:
        _memory.hold(t)
    return t


def _held(t: torch.Tensor) -> None:
    """Count the storage of a tagged tensor an op wrote in place (``out=``, ``set_``,
    ``resize_`` may have given it another storage or size)."""
    if _memory is not None and on_accelerator(t):
        _memory.hold(t)


def to_accelerator(t: torch.Tensor) -> torch.Tensor:
    """A tagged copy of ``t`` (``t`` itself when it is tagged already), as ``t.cuda()``."""
    if on_accelerator(t):
        return t
    with torch._C.DisableTorchFunction():
        return _tag(t.clone())


def _is_accel_device(d: Any) -> bool | None:
    """True for a CUDA device (a device index too), False for another one, None for none."""
    if d is None:
        return None
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.split(":")[0] == "cuda"
    if isinstance(d, int) and not isinstance(d, bool):
        return True
    return False


def _any_tagged(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return on_accelerator(obj)
    if isinstance(obj, (list, tuple)):
        return any(_any_tagged(o) for o in obj)
    if isinstance(obj, dict):
        return any(_any_tagged(o) for o in obj.values())
    return False


def _tag_outputs(out: Any, keep: tuple) -> Any:
    """Tag the tensors of ``out`` except those that are arguments (in-place results, whose
    storage is counted again if it changed)."""
    if isinstance(out, torch.Tensor):
        if any(out is k for k in keep):
            _held(out)
        else:
            _tag(out)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _tag_outputs(o, keep)
    return out


def _target(func: Callable, args: tuple, kwargs: dict) -> tuple[bool | None, tuple, dict]:
    """``(where the result goes: True accelerator, False host, None as its inputs; args,
    kwargs)`` of a call, a CUDA device in them replaced by the CPU (the data stays there)."""
    target = _is_accel_device(kwargs.get("device"))
    if target:
        kwargs = {**kwargs, "device": "cpu"}
    if func is torch.Tensor.to and len(args) > 1:
        first = args[1]
        if isinstance(first, torch.Tensor):
            target = on_accelerator(first)
        elif isinstance(first, (torch.device, str, int)) and not isinstance(first, bool):
            target = _is_accel_device(first)
            if target:
                args = (args[0], "cpu", *args[2:])
    elif func is torch.Tensor.cpu:
        target = False
    return target, args, kwargs


def _mixed(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first host tensor (not 0-d) of a call that also has accelerator tensors, where a
    GPU would refuse the mix; None when the call is fine."""
    if func in _MIXING_ALLOWED:
        return None
    tensors = list(_tensors((args, tuple(kwargs.values()))))
    if not any(on_accelerator(t) for t in tensors):
        return None
    return next((t for t in tensors if not on_accelerator(t) and t.dim() > 0), None)


class _AcceleratorMode(TorchFunctionMode):
    """The tagging: device arguments, propagation, the getters, the refusal of mixed calls
    (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tagged = _any_tagged(args) or _any_tagged(kwargs)
        owner = getattr(func, "__self__", None)
        if tagged and owner is not None and owner in _GETTERS:
            return _GETTERS[owner]
        name = getattr(func, "__name__", "")
        # ``t.data = value`` (Module._apply): t goes where value lives
        if owner is _DATA and name == "__set__":
            func(*args, **kwargs)
            if isinstance(args[1], torch.Tensor):
                setattr(args[0], _TAG, on_accelerator(args[1]))
                _held(args[0])
            return None
        # a parameter's gradient lives where the parameter does
        if owner is _GRAD and name == "__get__" and tagged:
            out = func(*args, **kwargs)
            return out if out is None else _tag(out)
        host = _mixed(func, args, kwargs) if tagged else None
        if host is not None:
            raise RuntimeError(
                f"{getattr(func, '__qualname__', func)} called from {_caller()} with accelerator "
                f"tensors and a host tensor (shape {tuple(host.shape)}, dtype {host.dtype}): a "
                f"GPU refuses this (\"Expected all tensors to be on the same device\")")
        if tagged and func is torch.Tensor.get_device:
            return ACCELERATOR.index
        if func is torch.Tensor.cuda:
            return to_accelerator(args[0])
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            with self:  # the backward pass runs inside this call: keep tagging there
                return _backward(func, args, kwargs)
        if kwargs.get("pin_memory"):  # page-locked host memory: plain host memory here
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.addmm and kwargs.get("out_dtype") is not None and tagged:
            return _addmm_out_dtype(*args, **kwargs)
        target, args, kwargs = _target(func, args, kwargs)
        out = func(*args, **kwargs)
        source = args[0] if args else None
        if target is False:
            if out is source and on_accelerator(source):  # .cpu() of a "device" tensor copies
                with torch._C.DisableTorchFunction():
                    out = source.clone()
            return out
        if target and out is source and not on_accelerator(source):
            with torch._C.DisableTorchFunction():
                out = source.clone()  # .to("cuda") of a host tensor copies
        if target or tagged:
            keep = tuple(a for a in (*args, kwargs.get("out")) if isinstance(a, torch.Tensor))
            _tag_outputs(out, keep if not target else ())
        return out


def _addmm_out_dtype(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *,
                     out_dtype: torch.dtype, beta: float = 1, alpha: float = 1,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA's ``addmm`` into a wider dtype (bf16 operands, an fp32 result and accumulator),
    which the CPU lacks: the same sum in ``out_dtype``, the operands' upcast copies made with
    the mode off (not counted: the GPU's GEMM makes none)."""
    with torch._C.DisableTorchFunction():
        res = torch.addmm(input.to(out_dtype), mat1.to(out_dtype), mat2.to(out_dtype),
                          beta=beta, alpha=alpha)
        if out is None:
            return _tag(res)
        out.copy_(res)
    _held(out)
    return out


def _backward(func: Callable, args: tuple, kwargs: dict) -> None:
    """``Tensor.backward`` / ``torch.autograd.backward`` without their torch-function dispatch,
    which would run the engine with the mode off: the default gradients (``ones_like``, tagged
    like the outputs), then the engine (the CPU engine runs the graph on this thread, so inside
    the mode)."""
    a = _BACKWARD_SIGNATURES[func].bind(*args, **kwargs).arguments
    tensors = a["self"] if "self" in a else a["tensors"]
    grads = a.get("gradient", a.get("grad_tensors"))
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grads is None or isinstance(grads, torch.Tensor):
        grads = [grads] * len(tensors)
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads))
    inputs = a.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else \
        tuple(inputs)
    create_graph = a.get("create_graph", False)
    keep = a.get("retain_graph")
    _engine_run_backward(tensors, grads, create_graph if keep is None else keep, create_graph,
                         inputs, allow_unreachable=True, accumulate_grad=True)


def _caller() -> str:
    """``file:line`` of the first frame outside this module and torch."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        # other torch-function modes in the stack (the CPU shim's) are not the caller either
        if path != _THIS_FILE and not path.startswith(_TORCH_DIR + os.sep) and \
                frame.f_code.co_name != "__torch_function__":
            rel = os.path.relpath(path)
            return f"{path if rel.startswith(os.pardir) else rel}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, _REAL_P2POP):
        yield obj.tensor


def _checked(name: str, real: Callable, calls: list[str]) -> Callable:
    def wrapper(*args, **kwargs):
        where = _caller()
        calls.append(f"{name} {where}")
        for t in _tensors((args, tuple(kwargs.values()))):
            if not on_accelerator(t):
                raise AssertionError(
                    f"torch.distributed.{name} called from {where} with a host tensor "
                    f"(shape {tuple(t.shape)}, dtype {t.dtype}): on NCCL every tensor of a "
                    f"collective must live on the process group's device (cuda)")
        with torch._C.DisableTorchFunction():  # the real op sees plain host tensors
            return real(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__wrapped__ = real
    return wrapper


def _p2p_op_class(real_ops: dict) -> type:
    base = _REAL_P2POP

    class P2POp(base):
        """``torch.distributed.P2POp`` that accepts the wrapped ``isend`` / ``irecv``."""

        def __new__(cls, op, tensor, *args, **kwargs):
            return base.__new__(cls, real_ops.get(op, op), tensor, *args, **kwargs)

        def __init__(self, op, tensor, *args, **kwargs):
            super().__init__(real_ops.get(op, op), tensor, *args, **kwargs)

    return P2POp


def _autograd_patches(patch: Callable) -> None:
    """Autograd's own nodes run in C++, outside the mode, so the gradients they hand a custom
    ``Function``'s backward are untagged; on a GPU a gradient lives where its forward output
    does. So a Function whose outputs are tagged marks its node, and the node's incoming
    gradients are tagged."""
    function_apply = torch.autograd.Function.apply.__func__
    node_apply = torch.autograd.function.BackwardCFunction.apply

    def apply(cls, *args, **kwargs):
        out = function_apply(cls, *args, **kwargs)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if on_accelerator(o) and o.grad_fn is not None:
                setattr(o.grad_fn, _TAG, True)
        return out

    def backward_apply(node, *grads):
        if getattr(node, _TAG, False):
            for g in grads:
                if isinstance(g, torch.Tensor):
                    _tag(g)
        return node_apply(node, *grads)

    patch(torch.autograd.Function, "apply", classmethod(apply))
    patch(torch.autograd.function.BackwardCFunction, "apply", backward_apply)


def _parameter_patch(patch: Callable) -> None:
    """``nn.Parameter(t)`` makes a new tensor object of ``t``'s data outside torch functions:
    it lives where ``t`` does (a layer that allocates its weight on the GPU)."""
    real_new = torch.nn.Parameter.__new__

    def new(cls, data=None, requires_grad=True):
        param = real_new(cls, data, requires_grad)
        if on_accelerator(data):
            _tag(param)
        return param

    patch(torch.nn.Parameter, "__new__", staticmethod(new))


@contextlib.contextmanager
def simulated_accelerator() -> Iterator[list[str]]:
    """Pretend, in this process, that NCCL runs the collectives on a GPU (module docstring).

    Yields the list of the checked calls so far, ``"<function> <file>:<line>"`` each (so a
    test can tell that the collectives it means to check did run under the check).
    """
    global _memory
    saved: dict[tuple[Any, str], Any] = {}
    calls: list[str] = []
    outer_memory = _memory

    def patch(obj: Any, name: str, value: Any) -> None:
        # a class's own attribute as stored (a classmethod, not the bound method getattr gives)
        saved[(obj, name)] = vars(obj)[name] if name in vars(obj) else getattr(obj, name)
        setattr(obj, name, value)

    real_ops = {}
    try:
        for name in CHECKED_FUNCTIONS:
            if hasattr(dist, name):
                real = getattr(dist, name)
                patch(dist, name, _checked(name, real, calls))
                real_ops[getattr(dist, name)] = real
        patch(dist, "P2POp", _p2p_op_class(real_ops))
        patch(dist, "get_backend", lambda group=None: "nccl")
        patch(torch.cuda, "current_device", lambda: ACCELERATOR.index)
        patch(placement, "_simulated_device", ACCELERATOR)
        # torch's own logging asks NCCL its version when the backend says "nccl"
        patch(torch.cuda.nccl, "version", lambda: (0, 0, 0))
        # no NCCL group can be made without a GPU (a CUDA build of torch has NCCL): links
        # between processes that both say "cuda" go over the host, as where NCCL is missing
        patch(dist, "is_nccl_available", lambda: False)
        for name, fn in (("memory_allocated", memory_allocated),
                         ("max_memory_allocated", max_memory_allocated),
                         ("reset_peak_memory_stats", reset_peak_memory_stats)):
            patch(torch.cuda, name, fn)
        _autograd_patches(patch)
        _parameter_patch(patch)
        _memory = _Memory()
        with _AcceleratorMode():
            yield calls
    finally:
        _memory = outer_memory
        for (obj, name), value in saved.items():
            setattr(obj, name, value)
