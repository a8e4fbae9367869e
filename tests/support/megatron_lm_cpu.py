"""Test-only: run Megatron-LM's real, patched ``pretrain_gpt.py`` on a CPU (gloo). Not for users.

    PYTHONPATH=$MEGATRON_LM_DIR:$PYTHONPATH torchrun --nproc-per-node N \\
        tests/support/megatron_lm_cpu.py $MEGATRON_LM_DIR/pretrain_gpt.py <its flags> \\
        --distributed-backend gloo --transformer-impl local --use-cpu-initialization ...

Megatron-LM's own start-up insists on CUDA in places that are about devices, not maths; this
launcher replaces exactly those, then runs the script as ``__main__`` with ``runpy`` (the
checkout's code, unchanged):

* ``initialize_megatron`` asserts ``torch.cuda.is_available()``: called with
  ``allow_no_cuda=True``;
* ``_initialize_distributed`` sets up model parallelism only when ``torch.cuda.device_count()
  > 0`` and then calls ``torch.cuda.set_device``: one pretend device, ``set_device`` a no-op, and
  ``init_process_group`` without the CUDA ``device_id`` it then passes;
* streams, events, device properties and memory statistics (``get_model``'s
  ``torch.cuda.Stream()``, timers, ``validate_args`` for TP > 1, the memory report): host
  stand-ins that record nothing on a device;
* the JIT warmup of fused GPU kernels (``_warmup_jit_function``): skipped. Its random inputs
  are drawn on "cuda", which here is the CPU generator (the shim's stand-in for the CUDA one),
  and would move the weights a ``--use-cpu-initialization`` run draws next; on a GPU they come
  from the CUDA generator and leave the CPU one alone;
* ``--sequence-parallel`` with ``--transformer-impl local``: Megatron-Core's torch norm
  (``WrappedTorchNorm``) refuses sequence parallelism, where on a GPU Transformer Engine's norms
  take it; with sequence parallelism on it builds megatron_kd's
  :class:`~megatron_kd.integration.cpu_shim.SequenceParallelNorm` instead (the same torch
  module, its weights marked ``sequence_parallel`` as Transformer Engine marks its own, so
  Megatron-LM's ``finalize_model_grads`` sums their gradients over the TP group); off, it is
  untouched;
* ``--context-parallel-size > 1`` with ``--transformer-impl local``: Megatron-Core's local
  ``DotProductAttention`` asserts context-parallel size 1, where on a GPU Transformer Engine's
  attention splits the sequence; with context parallelism on it builds megatron_kd's
  :class:`~megatron_kd.integration.context_parallel.ContextParallelAttention` instead (the same
  attention over the context-parallel group's gathered keys and values, under the causal mask of
  the true positions); off, it is untouched. It takes causal masks only: run with
  ``--no-create-attention-mask-in-dataloader`` (Transformer Engine's causal attention ignores the
  dataloader's mask too);
* Megatron-Core's own CUDA assumptions: megatron_kd's CPU shim
  (:mod:`megatron_kd.integration.cpu_shim`) and its device context around the whole run.

``torch.cuda.is_available()`` stays False, so megatron_kd itself and Megatron-Core's device
checks see a CPU. Nothing here changes what is computed.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import time

import torch
import torch.distributed as dist


class _Stream:
    """A CUDA stream that is the host's program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class _Event:
    """A CUDA event that records host time."""

    def __init__(self, *args, **kwargs) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


class _Properties:
    name, major, minor = "cpu", 0, 0
    total_memory = multi_processor_count = 0


def _stand_ins() -> None:
    cuda = torch.cuda
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda s: contextlib.nullcontext()
    cuda.set_stream = lambda s: None
    cuda.get_device_properties = lambda device=None: _Properties()
    cuda.get_device_capability = lambda device=None: (0, 0)
    cuda.get_device_name = lambda device=None: "cpu"
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.memory_stats = lambda device=None: {}
    cuda.reset_peak_memory_stats = lambda device=None: None

    init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        kwargs.pop("device_id", None)  # the pretend CUDA device: gloo on the host
        return init(*args, **kwargs)

    dist.init_process_group = init_process_group

    from megatron.training import initialize, training

    initialize_megatron = initialize.initialize_megatron

    def without_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    initialize.initialize_megatron = training.initialize_megatron = without_cuda
    if hasattr(initialize, "_warmup_jit_function"):
        initialize._warmup_jit_function = lambda *args, **kwargs: None
    _sequence_parallel_norm()
    _context_parallel_attention()


def _sequence_parallel_norm() -> None:
    """``WrappedTorchNorm`` (every local spec's norm) builds a sequence-parallel norm when the
    config asks for sequence parallelism, instead of asserting it away."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_kd.integration.cpu_shim import SequenceParallelNorm

    original = WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        if config.sequence_parallel:
            return SequenceParallelNorm(config, *args, **kwargs)
        return original(cls, config, *args, **kwargs)

    WrappedTorchNorm.__new__ = new


def _context_parallel_attention() -> None:
    """``DotProductAttention`` (the local spec's attention) builds a context-parallel attention
    when the config asks for context parallelism, instead of asserting it away."""
    # here, not at the top: the launcher patches torch.cuda before megatron is imported
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_kd.integration.context_parallel import ContextParallelAttention

    original = DotProductAttention.__new__

    def new(cls, *args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0]
        if cls is DotProductAttention and config.context_parallel_size > 1:
            # a subclass: Python then runs ContextParallelAttention.__init__ with these arguments
            return original(ContextParallelAttention)
        return original(cls)

    DotProductAttention.__new__ = new


def main() -> None:
    if torch.cuda.is_available():
        raise SystemExit("megatron_lm_cpu: a GPU is visible; run pretrain_gpt.py directly")
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(script)))
    from megatron_kd.integration.cpu_shim import device_context, install_cpu_shim

    install_cpu_shim()
    _stand_ins()
    with device_context():
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
