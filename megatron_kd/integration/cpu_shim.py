"""Run Megatron-Core on a machine without a GPU: a small, isolated shim.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the maths:

* ``torch.cuda.current_device()`` as the device of new tensors (rotary embeddings, the global
  memory buffer used by attention, DDP's gradient buffers);
* ``torch.cuda.synchronize()`` around timers and buffer frees, and (megatron-core 0.19)
  ``torch.cuda.current_stream()`` in DDP's gradient sync;
* the CUDA random-number generator, which the model-parallel RNG tracker saves, forks and
  restores (``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and
  ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``);
* gradient clipping (``clip_grad_by_total_norm_fp32`` asserts CUDA tensors);
* the mixture-of-experts all-to-all dispatcher (:func:`_install_moe_shim`): a CUDA side
  stream for its device-to-host copies, split sizes that only become host numbers when they
  were on a GPU, and a Transformer Engine GEMM the router names without importing it;
* Gated DeltaNet (Qwen3.5's linear attention, :func:`_install_gated_delta_net_shim`), whose
  kernels come from flash-linear-attention (Triton, GPU only): Megatron's own pure-torch
  chunked rule and a torch causal convolution stand in;
* the pipeline schedules (``get_forward_backward_func``), the optimizer and the default causal
  attention mask, which create small tensors with ``device="cuda"``;
* sequence parallelism with its torch norms (:class:`SequenceParallelNorm`, used wherever
  Transformer Engine is absent).

:func:`install_cpu_shim` redirects the first three to the CPU (the CPU generator stands in for
the CUDA generator, so the tracker's forks still give reproducible, rank-dependent streams) and
re-implements the clipping with the same maths. It does nothing when a GPU is present, and
installing it twice is the same as once. :class:`cuda_to_cpu` is a ``TorchFunctionMode`` that
rewrites ``device="cuda"`` (and ``Tensor.cuda()``, ``Tensor.to("cuda")``) to the CPU while
Megatron-Core code runs; it is a no-op context when a GPU is present.
:func:`checkpoint_save_strategy` writes ``dist_checkpointing``'s ``torch_dist`` format
in-process on CPU (Megatron's default writer forks processes).

Nothing here changes numerics: every patched call is about *where* a tensor lives or which
generator draws, never about what is computed.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import megatron.core.ssm.gated_delta_net as mcore_gdn
import torch
import torch.cuda.random as cuda_random
import torch.nn.functional as F
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.optimizer import clip_grads as mcore_clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.moe import moe_utils as mcore_moe_utils
from megatron.core.transformer.moe import token_dispatcher as mcore_token_dispatcher
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.overrides import TorchFunctionMode

from megatron_kd import placement

__all__ = [
    "SequenceParallelNorm",
    "checkpoint_save_strategy",
    "cpu_shim_installed",
    "cuda_to_cpu",
    "device_context",
    "install_cpu_shim",
    "on_cpu",
    "uninstall_cpu_shim",
]

# (object, attribute name) -> original value; empty when the shim is not installed.
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def on_cpu() -> bool:
    """True when no GPU is usable: the shim applies."""
    return not torch.cuda.is_available()


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    # The CPU generator plays the part of the CUDA one.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all in turn.
    torch.default_generator.manual_seed(int(seed))


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm,
                                      use_decoupled_grad: bool = False) -> None:
    # Megatron's version asserts CUDA tensors; the maths (scale every grad by
    # max_norm / (total_norm + 1e-6) when that is < 1) is the same here.
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def _noop(*args, **kwargs) -> None:
    return None


def _cpu_current_device() -> str | int:
    # the simulated accelerator's device index while it runs (its tensors are tagged host
    # tensors: megatron_kd.testing.devices), else the host
    simulated = placement._simulated_device
    return "cpu" if simulated is None else simulated.index


def _cpu_current_stream(device: Any = None):
    return torch.cpu.current_stream()


class _HostEvent:
    """Stands in for a CUDA event: the host's program order has already completed it."""

    def synchronize(self) -> None:
        return None


class _HostStream:
    """Stands in for a CUDA side stream on the host (work on it is ordinary host work)."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()


def _host_stream_context(stream: Any = None):
    return contextlib.nullcontext()


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    # Megatron's maybe_move_tensor_to_cpu converts only CUDA tensors, so on the host the
    # all-to-all split sizes stay tensors, which all_to_all_single does not take: convert here.
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _install_moe_shim() -> None:
    """The all-to-all token dispatcher and router on the host (megatron-core 0.16.1 and 0.19.2).

    * ``MoEAlltoAllTokenDispatcher.__init__``: ``cuda_dtoh_stream = torch.cuda.Stream()`` and
      ``_maybe_dtoh_and_synchronize``: ``torch.cuda.stream(...)``, ``record_event()``,
      ``d2h_event.synchronize()``; a host stream stands in.
    * ``moe_utils.maybe_move_tensor_to_cpu``: ``if torch.is_tensor(tensor) and tensor.is_cuda``
      leaves the split sizes as tensors on the host; they are made numpy arrays, as on a GPU.
    * ``moe_utils.RouterGatingLinearFunction.forward``: ``if te_general_gemm is not None``
      raises ``NameError`` without Transformer Engine in 0.16.1 (the name is bound only when
      the import succeeds); bound to None here, Megatron's own "no TE" value.
    """
    dispatcher = mcore_token_dispatcher.MoEAlltoAllTokenDispatcher
    if dispatcher.cuda_dtoh_stream is None:
        _patch(dispatcher, "cuda_dtoh_stream", _HostStream())
    _patch(torch.cuda, "stream", _host_stream_context)
    _patch(mcore_token_dispatcher, "maybe_move_tensor_to_cpu", _host_split_sizes)
    if not hasattr(mcore_moe_utils, "te_general_gemm"):
        _ORIGINALS[(mcore_moe_utils, "te_general_gemm")] = _UNBOUND
        mcore_moe_utils.te_general_gemm = None


def _torch_l2norm(x, dim=-1, eps=1e-6, output_dtype=None, **_):
    # fla.modules.l2norm.l2norm: x / sqrt(sum(x^2) + eps) (Hugging Face's l2norm is the same)
    y = x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return y if output_dtype is None else y.to(output_dtype)


def _torch_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, **_):
    # fla.modules.convolution.causal_conv1d as megatron-core 0.19 calls it:
    # x [b, s, d], weight [d, w] -> (y [b, s, d], final state)
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise ValueError("the CPU Gated DeltaNet convolution has no recurrent state or packed "
                         "sequences (cu_seqlens); those need flash-linear-attention on a GPU")
    s, d, w = x.shape[1], x.shape[2], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=w - 1, groups=d)[..., :s]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d activation {activation!r} is not supported on CPU")
    return y.transpose(1, 2), None


def _install_gated_delta_net_shim() -> None:
    """Gated DeltaNet without flash-linear-attention, with Megatron's own maths.

    * 0.16.1, ``megatron/core/ssm/gated_delta_net.py``: ``try: from fla... import`` leaves
      ``HAVE_FLA = False``, ``chunk_gated_delta_rule = None`` and ``l2norm`` unbound;
      ``GatedDeltaNet.__init__`` raises ``ImportError`` when ``not HAVE_FLA``; ``forward``
      calls ``l2norm(...)`` and ``chunk_gated_delta_rule(...)`` (the convolution falls back
      to ``nn.Conv1d`` because ``causal_conv1d_fn is None``).
    * Megatron-LM f88b85f (a newer single module): as 0.16.1, but ``forward`` calls fla's
      ``causal_conv1d(...)`` by name (bound to None without fla) unless ``deterministic_mode``.
    * 0.19.2, the ``megatron/core/ssm/gated_delta_net/`` package: ``common.py`` binds
      ``HAVE_FLA`` and ``l2norm`` (``_GDNBase.__init__`` checks ``common.HAVE_FLA``,
      ``_prepare_input_for_gated_delta_rule`` calls ``common.l2norm``); ``gdn.py`` imports
      ``causal_conv1d`` and ``chunk_gated_delta_rule`` by name, so they are patched there.
      Megatron-LM main (d98e8a6, 2026-08) moved ``torch_chunk_gated_delta_rule`` to
      ``gdn.py``, which also imports ``l2norm`` by name.

    The rule becomes Megatron's ``torch_chunk_gated_delta_rule`` (what ``deterministic_mode``
    uses), the l2norm and the convolution their torch equivalents.
    """
    if hasattr(mcore_gdn, "__path__"):  # 0.19: a package
        # submodules of the 0.19 package only (0.16 has one module): imported by version
        common = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
        gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
        # the torch rule: in common.py (0.19.2) or gdn.py (Megatron-LM main d98e8a6)
        rule = getattr(common, "torch_chunk_gated_delta_rule", None) or \
            gdn.torch_chunk_gated_delta_rule
        _patch(common, "HAVE_FLA", True)
        _patch_or_add(common, "l2norm", _torch_l2norm)
        if hasattr(gdn, "l2norm"):  # main imports it into gdn.py by name
            _patch(gdn, "l2norm", _torch_l2norm)
        _patch(gdn, "chunk_gated_delta_rule", rule)
        _patch(gdn, "causal_conv1d", _torch_causal_conv1d)
        return
    torch_rule = mcore_gdn.torch_chunk_gated_delta_rule

    def _rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **_):
        # fla's keyword arguments (cu_seqlens, ...) that the torch rule does not take
        return torch_rule(q, k, v, g, beta, initial_state=initial_state,
                          output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    _patch(mcore_gdn, "HAVE_FLA", True)
    _patch_or_add(mcore_gdn, "l2norm", _torch_l2norm)
    _patch(mcore_gdn, "chunk_gated_delta_rule", _rule)
    if hasattr(mcore_gdn, "causal_conv1d"):  # f88b85f: fla's convolution, called by name
        _patch(mcore_gdn, "causal_conv1d", _torch_causal_conv1d)


def _patch_or_add(obj: Any, name: str, value: Any) -> None:
    """:func:`_patch` for an attribute that may be unbound (uninstall then deletes it)."""
    if not hasattr(obj, name):
        _ORIGINALS[(obj, name)] = _UNBOUND
        setattr(obj, name, value)
    else:
        _patch(obj, name, value)


_UNBOUND = object()  # marks an attribute the shim added (uninstall deletes it)


def _patch(obj: Any, name: str, value: Any) -> None:
    key = (obj, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(obj, name)
    setattr(obj, name, value)


class SequenceParallelNorm:
    """Megatron-Core's torch ``LayerNorm`` / ``RMSNorm`` (what ``WrappedTorchNorm`` builds), with
    its weights marked for sequence parallelism as Transformer Engine's norms mark theirs.

    Under sequence parallelism each tensor-parallel rank normalises its own slice of the
    sequence with a weight replicated over the TP group, so each rank's weight gradient is a
    partial sum; ``finalize_model_grads`` all-reduces the gradients of parameters carrying
    ``sequence_parallel=True`` over the TP group (``_allreduce_non_tensor_model_parallel_grads``)
    and nothing else does. ``WrappedTorchNorm`` refuses the setting instead, with the one line
    ``assert not config.sequence_parallel, f"sequence parallel not supported by torch
    LayerNorm"`` (``megatron/core/transformer/torch_norm.py``, megatron-core 0.16.1 and 0.19.2);
    ``TENorm`` marks its weights ``sequence_parallel = config.sequence_parallel``. This class does
    what ``WrappedTorchNorm`` does without that line and marks the weights as ``TENorm`` does;
    with sequence parallelism off it builds the very same module. Used only where Transformer
    Engine is absent (:mod:`megatron_kd.integration.gpt`); same constructor as
    ``WrappedTorchNorm``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or \
                config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma, persistent and memory-efficient layer norms "
                             "need Transformer Engine or Apex")
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: the torch norms are "
                             f"{sorted(norms)}")
        # in the parameters' dtype, as TENorm's (torch's fused norm wants input and weight alike)
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps,
                                           dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def cpu_shim_installed() -> bool:
    """Whether :func:`install_cpu_shim` is in effect in this process."""
    return bool(_ORIGINALS)


def install_cpu_shim() -> bool:
    """Redirect Megatron-Core's CUDA-only calls to the CPU when no GPU is present.

    Returns True when the shim is (now or already) installed, False when a GPU is present and
    nothing was changed. Idempotent.
    """
    if not on_cpu():
        return False
    if cpu_shim_installed():
        return True
    _patch(torch.cuda, "current_device", _cpu_current_device)
    _patch(torch.cuda, "synchronize", _noop)
    _patch(torch.cuda, "empty_cache", _noop)
    # megatron-core 0.19: DDP's gradient sync asks for the current CUDA stream
    # (param_and_grad_buffer.start_grad_sync); the host's program order is the stream here.
    _patch(torch.cuda, "current_stream", _cpu_current_stream)
    for mod in (torch.cuda, cuda_random):
        _patch(mod, "get_rng_state", _cpu_get_rng_state)
        _patch(mod, "set_rng_state", _cpu_set_rng_state)
        _patch(mod, "manual_seed", _cpu_manual_seed)
    _patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    # Gradient clipping: the optimizer module holds its own reference to the function.
    for mod in (mcore_clip_grads, mcore_optimizer):
        if hasattr(mod, "clip_grad_by_total_norm_fp32"):
            _patch(mod, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32)
    _install_moe_shim()
    _install_gated_delta_net_shim()
    _install_recompute_shim()
    return True


def _install_recompute_shim() -> None:
    """Activation recompute re-runs a layer's forward inside the backward of Megatron-Core's
    ``CheckpointFunction`` / ``CheckpointWithoutOutputFunction``: the autograd engine runs it
    without the caller's :class:`cuda_to_cpu` mode (Python function modes do not follow into
    backward), so the default causal mask's ``device="cuda"`` fails there. Their backwards run
    inside the mode here (megatron-core 0.16.1 and 0.19.2, ``tensor_parallel/random.py``)."""
    for cls in (mcore_random.CheckpointFunction, mcore_random.CheckpointWithoutOutputFunction):
        original = cls.backward

        def backward(ctx, *args, _original=original):
            with cuda_to_cpu():
                return _original(ctx, *args)

        _patch(cls, "backward", staticmethod(backward))


def uninstall_cpu_shim() -> None:
    """Restore every patched attribute (for tests)."""
    for (obj, name), value in reversed(list(_ORIGINALS.items())):
        if value is _UNBOUND:
            delattr(obj, name)
        else:
            setattr(obj, name, value)
    _ORIGINALS.clear()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class cuda_to_cpu(TorchFunctionMode):
    """While active, ``device="cuda"`` becomes ``"cpu"``, ``pin_memory=True`` False (the rotary
    embedding's context-parallel slice asks for it) and ``Tensor.cuda()`` is the identity.

    Needed around Megatron-Core's pipeline schedules on a CPU machine; entering it when a GPU is
    present is harmless (the rewrite is only applied when :func:`on_cpu` is True).
    """

    def __init__(self) -> None:
        super().__init__()
        # inactive under the simulated accelerator, which places "cuda" tensors itself
        self._active = on_cpu() and placement._simulated_device is None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._active:
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = {**kwargs, "device": "cpu"}
            if kwargs.get("pin_memory"):  # page-locked memory is for copies to a GPU
                kwargs = {**kwargs, "pin_memory": False}
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def device_context():
    """The context to run Megatron-Core schedules in: :class:`cuda_to_cpu` on CPU, else null."""
    return cuda_to_cpu() if on_cpu() else contextlib.nullcontext()


def checkpoint_save_strategy():
    """The ``dist_checkpointing`` save strategy to use: None (Megatron's default) on a GPU.

    On CPU, Megatron's default ``torch_dist`` writer starts a ``multiprocessing`` manager and
    forks writer processes, which a daemonic process (a worker of a process pool) may not do and
    which buys nothing without device-to-host copies to overlap. The CPU strategy writes the
    same ``torch_dist`` format in-process with ``torch.distributed.checkpoint.save``; Megatron's
    loader reads it unchanged.
    """
    if not on_cpu():
        return None
    class _InProcessTorchDistSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            # Same key translation as Megatron's async_save, then a synchronous DCP save.
            sharded_state_dict, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sharded_state_dict, False)
            dcp_save(
                pyt_state_dict,
                storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=mcore_torch.MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False),
            )

    return _InProcessTorchDistSaveStrategy("torch_dist", 1)
