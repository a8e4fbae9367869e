"""Device placement: :mod:`megatron_kd.placement` and what the simulated accelerator refuses.

No process group: single-process checks of the pieces the commands use (the commands themselves
run under the simulation in tests/e2e/test_gpu_placement.py).
"""

import os

import pytest
import torch

from megatron_kd.placement import check_module_device, compute_device, move_to_compute_device
from megatron_kd.testing.devices import on_accelerator, simulated_accelerator

THIS_FILE = os.path.basename(__file__)


def _module():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.RMSNorm(4))
    m.register_buffer("scale", torch.ones(4))
    return m


def test_compute_device_follows_the_machine_and_the_simulation():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert compute_device().type == expected
    with simulated_accelerator():
        assert compute_device() == torch.device("cuda", 0)
    assert compute_device().type == expected


def test_a_module_built_on_the_host_is_refused_by_name():
    with simulated_accelerator():
        m = _module()
        with pytest.raises(RuntimeError) as err:
            check_module_device(m, compute_device(), "the student")
    message = str(err.value)
    assert message.startswith("the student: 4 tensor(s) not on the compute device cuda:0")
    for name in ("0.weight (parameter on cpu)", "0.bias", "1.weight", "scale (buffer on cpu)"):
        assert name in message


def test_moved_module_its_gradients_and_new_parameters_live_on_the_accelerator():
    with simulated_accelerator():
        m = move_to_compute_device(_module())
        assert all(on_accelerator(p) for p in m.parameters())
        assert all(on_accelerator(b) for b in m.buffers())
        m(torch.randn(2, 3).cuda()).sum().backward()
        assert all(on_accelerator(p.grad) for p in m.parameters())
        # a layer allocating its weight on the device (Megatron-Core's GPU initialisation)
        assert on_accelerator(torch.nn.Parameter(torch.empty(2, device="cuda")))
        assert not on_accelerator(torch.nn.Parameter(torch.empty(2)))


def test_mixing_host_and_accelerator_tensors_is_refused_naming_the_caller():
    with simulated_accelerator():
        x = torch.randn(2, 3).cuda()
        norm = torch.nn.RMSNorm(3)  # built on the host, as torch's norms are
        with pytest.raises(RuntimeError, match=rf"{THIS_FILE}:\d+ .*host tensor \(shape \(3,\)"):
            norm(x)
        with pytest.raises(RuntimeError, match="host tensor"):
            torch.cat([x, torch.zeros(2, 3)])
        # what a GPU allows: 0-d host scalars, copies either way, host index tensors
        assert on_accelerator(x * torch.tensor(2.0))
        y = torch.empty(2, 3).cuda()
        y.copy_(torch.ones(2, 3))
        y[0] = torch.zeros(3)
        assert on_accelerator(x[torch.tensor([1])])
        assert not on_accelerator(x.cpu() + torch.ones(2, 3))


def test_the_simulation_leaves_numbers_alone():
    torch.manual_seed(0)
    m, x = _module(), torch.randn(5, 3)
    expected = m(x)
    with simulated_accelerator():
        moved = move_to_compute_device(m)
        got = moved(x.cuda()).cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
