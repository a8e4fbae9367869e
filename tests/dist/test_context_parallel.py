"""Context parallelism on the CPU (no Transformer Engine): the load-balanced split and the
context-parallel attention of :mod:`megatron_kd.integration.context_parallel`, against the same
model at CP 1 by parity (2 gloo ranks): hidden states at each rank's positions and, after
Megatron-Core's ``finalize_model_grads`` (which sums gradients over data x context parallel),
every parameter's gradient.
"""

import pytest
import torch
from support.archs import tiny_arch

from megatron_kd.integration.context_parallel import cp_positions

WORLD = 2
SEQ, BATCH = 16, 2


def test_positions_are_megatrons_load_balanced_chunks():
    # 2 x cp chunks of 2; rank r holds chunks r and 2cp - 1 - r
    assert cp_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert cp_positions(8, 0, 1).tolist() == list(range(8))
    every = torch.cat([cp_positions(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="--seq-length 10 is not divisible by 2 x "
                                         "--context-parallel-size 2 = 4"):
        cp_positions(10, 0, 2)


def _run(model, tokens, weights, positions):
    """hidden states at ``positions`` and the loss sum(hidden * weights[positions])."""
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.output_layer import to_sbh

    pos = positions.unsqueeze(0).expand(BATCH, -1)
    with device_context():
        hidden = to_sbh(model(tokens[:, positions], pos, None))  # [s/cp, b, h]
    return hidden, (hidden * weights[positions]).sum()


def case_parity(ctx, ckpt_dir, arch_kw):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_kd.integration.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import bypass_output_layer

    arch = tiny_arch(**arch_kw)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=g)
    weights = torch.randn(SEQ, BATCH, arch.hidden_size, generator=g)
    with model_parallel(tp=1):
        model = bypass_output_layer(build_gpt_model(arch, seed=5))
        save_model_checkpoint(model, arch, ckpt_dir)
        full, loss = _run(model, tokens, weights, torch.arange(SEQ))
        loss.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with model_parallel(cp=2):
        # a summed loss, as the trainer's: DDP does not divide by the data x context ranks
        model = build_gpt_model(arch, seed=9, calculate_per_token_loss=True)
        load_model_checkpoint(model, ckpt_dir)
        bypass_output_layer(model)
        ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        positions = cp_positions(SEQ, ps.get_context_parallel_rank(), 2)
        hidden, loss = _run(ddp, tokens, weights, positions)
        loss.backward()
        finalize_model_grads([ddp])
        grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    return {"hidden_err": float((hidden - full[positions]).abs().max()),
            "grad_errs": {n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                          for n, g in ref.items()}}


@pytest.mark.parametrize("arch_kw", [{"qk_layernorm": True},
                                     {"window_size": 5, "window_layers": [0]}],
                         ids=["causal", "sliding-window"])
def test_context_parallel_attention_equals_cp1(dist_pool_factory, tmp_path, arch_kw):
    pool = dist_pool_factory(WORLD)
    for r in pool.run(case_parity, str(tmp_path / "ckpt"), arch_kw):
        # fp32: the same sums, the softmax over keys gathered in another order
        assert r["hidden_err"] < 1e-5
        assert max(r["grad_errs"].values()) < 1e-5, r["grad_errs"]
