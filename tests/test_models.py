"""megatron_kd.models: architecture config, build, dist_checkpointing save/load with resharding."""


import pytest
import torch

from megatron_kd.models import GPTArchConfig, pad_vocab_size


def tiny_arch(**overrides) -> GPTArchConfig:
    kw = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 64, "vocab_size": 500, "padded_vocab_size": 512,
              "max_position_embeddings": 32}
    kw.update(overrides)
    return GPTArchConfig(**kw)


# --- tier 0: no process group ---------------------------------------------------------------

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


# --- tier 1: gloo ranks ---------------------------------------------------------------------

def _logits(model, ids):
    """Full-vocabulary logits [b, s, V] gathered over the tensor-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_kd.megatron_cpu import device_context

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad(), device_context():
        local = model(ids, pos, None)
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def case_reshard(ctx, ckpt_dir, tie):
    from megatron_kd.models import (
        build_gpt_model,
        load_model_checkpoint,
        save_model_checkpoint,
    )
    from megatron_kd.training.parallel import model_parallel

    arch = tiny_arch(tie_embeddings=tie)
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with model_parallel(tp=2):
        model = build_gpt_model(arch, seed=11)
        ref = _logits(model, ids)
        save_model_checkpoint(model, arch, ckpt_dir, extra={"origin": "test"})
    with model_parallel(tp=1):
        other = build_gpt_model(arch, seed=99)
        before = (_logits(other, ids) - ref).abs().max().item()
        load_model_checkpoint(other, ckpt_dir)
        after = (_logits(other, ids) - ref).abs().max().item()
        # Same seed at TP=1 gives the same weights as at TP=2 (CPU init draws the full matrix).
        same_seed = build_gpt_model(arch, seed=11)
        seed_diff = (_logits(same_seed, ids) - ref).abs().max().item()
    return before, after, seed_diff


@pytest.mark.parametrize("tie", [False, True])
def test_save_tp2_load_tp1(dist_pool_factory, tmp_path, tie):
    pool = dist_pool_factory(2)
    for before, after, seed_diff in pool.run(case_reshard, str(tmp_path / "ckpt"), tie):
        assert before > 1e-3  # a different init really differs
        # fp32, same weights, different TP split of the matmuls: only summation order differs.
        assert after < 1e-5
        assert seed_diff < 1e-5
    from megatron_kd.models import read_checkpoint_arch, read_checkpoint_extra
    assert read_checkpoint_arch(tmp_path / "ckpt") == tiny_arch(tie_embeddings=tie)
    assert read_checkpoint_extra(tmp_path / "ckpt") == {"origin": "test"}


def case_mismatch(ctx, ckpt_dir):
    from megatron_kd.models import (
        build_gpt_model,
        load_model_checkpoint,
        save_model_checkpoint,
    )
    from megatron_kd.training.parallel import model_parallel

    with model_parallel(tp=2):
        save_model_checkpoint(build_gpt_model(tiny_arch()), tiny_arch(), ckpt_dir)
        wide = build_gpt_model(tiny_arch(hidden_size=64, vocab_size=900, padded_vocab_size=1024))
        try:
            load_model_checkpoint(wide, ckpt_dir)
        except ValueError as e:
            return str(e)
    return None


def test_load_mismatch_names_fields(dist_pool_factory, tmp_path):
    pool = dist_pool_factory(2)
    for msg in pool.run(case_mismatch, str(tmp_path / "ckpt")):
        assert msg is not None
        assert "hidden_size: model has 64, checkpoint has 32" in msg
        assert "padded_vocab_size" in msg and "vocab_size" in msg


def test_not_a_checkpoint(tmp_path):
    from megatron_kd.models import read_checkpoint_arch
    with pytest.raises(ValueError, match="model_config.json"):
        read_checkpoint_arch(tmp_path)


# --- the CPU shim ---------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is only active without a GPU")
def test_cpu_shim_idempotent_and_reversible():
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_kd import megatron_cpu

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
        megatron_cpu.uninstall_cpu_shim()
        assert torch.cuda.current_device is original
    finally:
        if was_installed:
            megatron_cpu.install_cpu_shim()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rewrite is only active without a GPU")
def test_cuda_to_cpu_mode():
    from megatron_kd.megatron_cpu import device_context

    with device_context():
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2).cuda()
        z = torch.ones(2).to("cuda")
        w = torch.tensor([1.0], device=torch.device("cuda"))
    assert {t.device.type for t in (x, y, z, w)} == {"cpu"}
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # outside the context nothing is rewritten


def case_bypass(ctx, tie):
    from megatron.core import parallel_state as ps

    from megatron_kd.integration import (
        bypass_output_layer,
        output_layer_bypassed,
        output_layer_weight,
        to_sbh,
    )
    from megatron_kd.megatron_cpu import device_context
    from megatron_kd.models import build_gpt_model
    from megatron_kd.training.parallel import model_parallel

    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).unsqueeze(0).expand_as(ids)
    with model_parallel(tp=2), torch.no_grad(), device_context():
        model = build_gpt_model(tiny_arch(tie_embeddings=tie))
        logits = model(ids, pos, None)  # [b, s, V/tp]
        with output_layer_bypassed(model):
            hidden = to_sbh(model(ids, pos, None))  # [s, b, h]
        again = model(ids, pos, None)  # the output layer is back
        bypass_output_layer(model)
        bypass_output_layer(model)  # idempotent
        hidden2 = to_sbh(model(ids, pos, None))
        weight = output_layer_weight(model)
        local_vocab = 512 // ps.get_tensor_model_parallel_world_size()
        assert weight.shape == (local_vocab, 32) and hidden.shape == (16, 2, 32)
        # fp32 matmul of the same operands in another association order: ~1e-7
        diff = (hidden.transpose(0, 1) @ weight.t() - logits).abs().max().item()
        return diff, torch.equal(again, logits), torch.equal(hidden, hidden2)


@pytest.mark.parametrize("tie", [False, True])
def test_bypass_gives_output_layer_input(dist_pool_factory, tie):
    for diff, restored, same in dist_pool_factory(2).run(case_bypass, tie):
        assert diff < 1e-5 and restored and same
