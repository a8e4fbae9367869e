"""The architecture config, its checks, and the CPU shim (no process group); its layout
rules are tests/unit/test_layout.py's."""


import pytest
import torch
from support.archs import tiny_arch

from megatron_kd.arch import GPTArchConfig


def test_arch_roundtrip():
    arch = tiny_arch(tie_embeddings=True, rotary_base=5e5)
    assert GPTArchConfig.from_dict(arch.to_dict()) == arch


@pytest.mark.parametrize("bad, match", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"padded_vocab_size": 400}, "padded_vocab_size"),
    ({"num_query_groups": 3}, "num_query_groups"),
    ({"hidden_size": 30}, "divisible by num_attention_heads"),
    ({"normalization": "BatchNorm"}, "normalization"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"moe_ffn_hidden_size": 16}, "needs num_experts"),
    ({"num_experts": 4, "moe_router_topk": 5}, "exceeds num_experts"),
    ({"num_experts": 0}, "num_experts"),
    ({"window_layers": [0]}, "needs window_size"),
    ({"window_size": 4, "window_layers": [7]}, "outside"),
    ({"gated_activation": "relu"}, "gated_activation"),
    ({"position_embedding_type": "yarn"}, "YaRN needs both"),
    ({"yarn_factor": 4.0}, "YaRN needs both"),
])
def test_arch_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_arch(**bad)


def test_arch_unknown_field():
    d = tiny_arch().to_dict()
    d["hidden_sise"] = 3
    with pytest.raises(ValueError, match="hidden_sise"):
        GPTArchConfig.from_dict(d)


def test_not_a_checkpoint(tmp_path):
    from megatron_kd.integration.checkpoint import read_checkpoint_arch
    with pytest.raises(ValueError, match="model_config.json"):
        read_checkpoint_arch(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is only active without a GPU")
def test_cpu_shim_idempotent_and_reversible():
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_kd.integration import cpu_shim as megatron_cpu

    was_installed = megatron_cpu.cpu_shim_installed()
    megatron_cpu.uninstall_cpu_shim()
    original = torch.cuda.current_device
    try:
        assert megatron_cpu.install_cpu_shim() is True
        patched = torch.cuda.current_device
        assert megatron_cpu.install_cpu_shim() is True  # twice == once
        assert torch.cuda.current_device is patched and patched() == "cpu"
        # the CUDA RNG the tracker forks is the CPU generator
        torch.cuda.manual_seed(3)
        a = torch.rand(2)
        mcore_random._set_cuda_rng_state(torch.cuda.get_rng_state())
        torch.manual_seed(3)
        assert torch.equal(a, torch.rand(2))
        # the MoE dispatcher's host stand-ins, and the name 0.16.1 leaves unbound without TE
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert splits.tolist() == [3, 1] and not torch.is_tensor(splits)
        assert moe_utils.te_general_gemm is None or callable(moe_utils.te_general_gemm)
        megatron_cpu.uninstall_cpu_shim()
        assert torch.cuda.current_device is original
        assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None
    finally:
        if was_installed:
            megatron_cpu.install_cpu_shim()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rewrite is only active without a GPU")
def test_cuda_to_cpu_mode():
    from megatron_kd.integration.cpu_shim import device_context

    with device_context():
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2).cuda()
        z = torch.ones(2).to("cuda")
        w = torch.tensor([1.0], device=torch.device("cuda"))
    assert {t.device.type for t in (x, y, z, w)} == {"cpu"}
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # outside the context nothing is rewritten
