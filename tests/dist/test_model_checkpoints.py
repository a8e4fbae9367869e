"""Model build, ``dist_checkpointing`` save/load with resharding, and the output-layer bypass on
2 gloo ranks."""


import pytest
import torch
from support.archs import tiny_arch


def _logits(model, ids):
    """Full-vocabulary logits [b, s, V] gathered over the tensor-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_kd.integration.cpu_shim import device_context

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad(), device_context():
        local = model(ids, pos, None)
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def case_reshard(ctx, ckpt_dir, tie):
    from megatron_kd.integration.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

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
    from megatron_kd.integration.checkpoint import read_checkpoint_arch, read_checkpoint_extra
    assert read_checkpoint_arch(tmp_path / "ckpt") == tiny_arch(tie_embeddings=tie)
    assert read_checkpoint_extra(tmp_path / "ckpt") == {"origin": "test"}


def case_mismatch(ctx, ckpt_dir):
    from megatron_kd.integration.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

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


def case_bypass(ctx, tie):
    from megatron.core import parallel_state as ps

    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import (
        bypass_output_layer,
        output_layer_bypassed,
        output_layer_weight,
        to_sbh,
    )

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


def case_teacher_build_keeps_random_state(ctx, ckpt_dir):
    import dataclasses

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.teacher import build_frozen_teacher

    # a Gated DeltaNet layer: Megatron-Core initialises its decay and convolution parameters
    # even with perform_initialization=False
    arch = dataclasses.replace(tiny_arch(), kv_channels=16, linear_attention_layers=[0],
                               linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8)
    with model_parallel(tp=1):
        save_model_checkpoint(build_gpt_model(arch, seed=3), arch, ckpt_dir)
        before = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
        build_frozen_teacher(arch, ckpt_dir, dtype=torch.float32)
        after = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    return (torch.equal(before[0], after[0]),
            sorted(before[1]) == sorted(after[1]) and
            all(torch.equal(before[1][k], after[1][k]) for k in before[1]))


def test_building_a_teacher_draws_nothing_from_the_student_streams(dist_pool_factory,
                                                                   tmp_path):
    # In Megatron-LM's pretrain_gpt.py the teacher is built before the student: a draw here
    # moved the student's initial weights (seen only with the real script).
    pool = dist_pool_factory(2)
    for cpu_same, tracker_same in pool.run(case_teacher_build_keeps_random_state,
                                           str(tmp_path / "ckpt")):
        assert cpu_same and tracker_same
