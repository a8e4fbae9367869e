"""The architecture config, its checks, and the CPU shim (no process group)."""


import pytest
import torch
from support.archs import tiny_arch

from megatron_kd.arch import GPTArchConfig, check_sequence_split, sequence_parts
from megatron_kd.parallel import pad_vocab_size


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


def test_tp_check():
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        tiny_arch().check_tensor_parallel(3)
    assert pad_vocab_size(500, 2) == 512
    assert pad_vocab_size(49152, 2) == 49152


def test_expert_parallel_check():
    moe = tiny_arch(num_experts=4, moe_ffn_hidden_size=12)
    moe.check_expert_parallel(2)
    with pytest.raises(ValueError, match="does not divide num_experts=4"):
        moe.check_expert_parallel(3)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        tiny_arch().check_expert_parallel(2)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=12"):
        moe.check_tensor_parallel(8)
    assert moe.expert_ffn_hidden_size == 12 and tiny_arch().num_experts is None


def test_context_parallel_check():
    hybrid = tiny_arch(linear_attention_layers=[0], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    hybrid.check_context_parallel(1)
    tiny_arch().check_context_parallel(4)  # softmax attention splits over any cp
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 with a Gated DeltaNet "
                                         r"student \(layers \[0\]\): a Gated DeltaNet "
                                         r"recurrence runs .*"
                                         r"no context parallelism.*; use cp 1$"):
        hybrid.check_context_parallel(2, advice="use cp 1")
    with pytest.raises(ValueError, match=r"^--context-parallel-size 4 with a colocated Gated "
                                         r"DeltaNet teacher \(layers \[0\]\): it runs with "
                                         r"the student's context parallelism"):
        hybrid.check_context_parallel(4, role="teacher", colocated=True)
    assert tiny_arch().context_parallel_limit is None
    assert "does not split over context-parallel ranks" in hybrid.context_parallel_limit


@pytest.mark.parametrize("seq, tp, cp, sp, parts, message", [
    (12, 2, 1, False, 1, None),  # without SP the sequence is not split over TP
    (12, 2, 1, True, 2, None),
    (13, 2, 1, True, 2, "--seq-length 13 is not divisible by --tensor-model-parallel-size 2 "
                        "(--sequence-parallel) = 2: each sequence is split over those ranks"),
    (12, 1, 3, False, 6, None),
    (12, 2, 3, True, 12, None),
    (18, 3, 2, False, 4, "--seq-length 18 is not divisible by 2 x --context-parallel-size 2 = 4"),
    (24, 3, 2, True, 12, None),
    (36, 2, 2, True, 8, "--seq-length 36 is not divisible by 2 x --context-parallel-size 2 x "
                        "--tensor-model-parallel-size 2 (--sequence-parallel) = 8"),
])
def test_sequence_split_check(seq, tp, cp, sp, parts, message):
    assert sequence_parts(tp=tp, cp=cp, sequence_parallel=sp) == parts
    if message is None:
        check_sequence_split(seq, tp=tp, cp=cp, sequence_parallel=sp)
    else:
        with pytest.raises(ValueError) as e:
            check_sequence_split(seq, tp=tp, cp=cp, sequence_parallel=sp)
        assert str(e.value).startswith(message)


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
