"""Where a process's models and tensors live: one compute device, chosen in one place.

* :func:`compute_device` -- the current CUDA device on a GPU machine, the CPU elsewhere. Every
  command builds (or moves) its models there and moves its batches, cache rows and teacher
  outputs there; nothing else in the package decides a device for a model.
* :func:`check_module_device` -- every parameter and buffer of a module on that device, or a
  ``RuntimeError`` naming the ones that are not. The commands run it after building a model:
  a module whose constructor made a tensor on the host (torch's own norms do) would otherwise
  fail much later, inside the first forward, as "Expected all tensors to be on the same
  device".

Under :func:`megatron_kd.testing.devices.simulated_accelerator` a CPU run reports the
(simulated) accelerator here, so the CPU tests run the same placement a GPU run does.
"""

from __future__ import annotations

import torch

__all__ = ["check_module_device", "compute_device", "move_to_compute_device"]

#: Set by the simulated accelerator while it is active (``megatron_kd.testing.devices``).
_simulated_device: torch.device | None = None


def compute_device() -> torch.device:
    """The device this process computes on: ``cuda:<current>`` with a GPU (or the simulated
    accelerator), else ``cpu``."""
    if _simulated_device is not None:
        return _simulated_device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    return expected.index is None or actual.index in (None, expected.index)


def check_module_device(module: torch.nn.Module, device: torch.device,
                        what: str = "model") -> None:
    """Raise ``RuntimeError`` naming every parameter and buffer of ``module`` not on ``device``
    (the first eight, and how many in all)."""
    device = torch.device(device)
    wrong = [f"{name} ({kind} on {t.device})"
             for kind, items in (("parameter", module.named_parameters()),
                                 ("buffer", module.named_buffers()))
             for name, t in items if not _same_device(t.device, device)]
    if wrong:
        shown = ", ".join(wrong[:8]) + (f", ... ({len(wrong)} in all)" if len(wrong) > 8 else "")
        raise RuntimeError(f"{what}: {len(wrong)} tensor(s) not on the compute device {device}: "
                           f"{shown}")


def move_to_compute_device(module: torch.nn.Module, device: torch.device | None = None,
                           what: str = "model") -> torch.nn.Module:
    """``module`` moved (in place, as ``Module.to``) to ``device`` (default
    :func:`compute_device`), then checked with :func:`check_module_device`."""
    device = compute_device() if device is None else torch.device(device)
    module.to(device)
    check_module_device(module, device, what)
    return module
