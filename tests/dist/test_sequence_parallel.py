"""Sequence parallelism on the CPU (no Transformer Engine): the torch norms of the CPU shim mark
their weights for the TP all-reduce of their gradients, as Transformer Engine's do, and after
Megatron-Core's ``finalize_model_grads`` every norm's gradient equals the one of the same model
and loss at TP 1 (2 gloo ranks). Parity, not reading: a norm left unmarked is caught (it is not
listed as marked, and its gradient stays its rank's partial sum).
"""

import pytest
import torch
from support.archs import tiny_arch

WORLD = 2
SEQ, BATCH = 8, 2

# A DeltaNet hybrid with QK norms: input and pre-MLP norms, the final norm, the QK norms and
# the DeltaNet's output norm (one weight shared by the heads of every TP rank).
HYBRID = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
          "qk_layernorm": True, "linear_attention_layers": [0], "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_conv_kernel_dim": 4, "attention_output_gate": True, "max_position_embeddings": SEQ}


def _loss(model, tokens, weights, tp_rank, tp):
    """A fixed linear function of the final hidden states: sum(hidden * weights) over this
    rank's share of the sequence (all of it at TP 1)."""
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.output_layer import to_sbh

    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    with device_context():
        hidden = to_sbh(model(tokens, pos, None))  # [s/tp, b, h] with sequence parallelism
    chunk = SEQ // tp
    return (hidden * weights[tp_rank * chunk:(tp_rank + 1) * chunk]).sum()


def case_norm_grads(ctx, ckpt_dir, arch_kw):
    """``{norm parameter name: its gradient}`` at TP 1 (each rank alone) and at TP 2 + SP after
    ``finalize_model_grads``, both from the same checkpoint and the same loss."""
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
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=g)
    weights = torch.randn(SEQ, BATCH, arch.hidden_size, generator=g)
    out = {}
    with model_parallel(tp=1):
        model = bypass_output_layer(build_gpt_model(arch, seed=5))
        save_model_checkpoint(model, arch, ckpt_dir)
        _loss(model, tokens, weights, 0, 1).backward()
        out["tp1"] = {n: p.grad.clone() for n, p in model.named_parameters()
                      if getattr(p, "sequence_parallel", None) is not None}
    with model_parallel(tp=2):
        model = build_gpt_model(arch, seed=9, sequence_parallel=True)
        load_model_checkpoint(model, ckpt_dir)
        bypass_output_layer(model)
        ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        tp_rank = ps.get_tensor_model_parallel_rank()
        _loss(ddp, tokens, weights, tp_rank, 2).backward()
        finalize_model_grads([ddp])
        out["sp"] = {n: p.main_grad.clone() for n, p in model.named_parameters()
                     if getattr(p, "sequence_parallel", None) is not None}
        out["marked"] = sorted(n for n, p in model.named_parameters()
                               if getattr(p, "sequence_parallel", False))
    return out


@pytest.mark.parametrize("arch_kw", [{"qk_layernorm": True}, HYBRID], ids=["dense", "deltanet"])
def test_sequence_parallel_norm_gradients_equal_tp1(dist_pool_factory, tmp_path, arch_kw):
    pool = dist_pool_factory(WORLD)
    results = pool.run(case_norm_grads, str(tmp_path / "ckpt"), arch_kw)
    for r in results:
        assert set(r["sp"]) == set(r["tp1"]) and r["sp"]
        assert r["marked"] == sorted(r["sp"])  # every torch norm's weight, and only those
        for name, grad in r["tp1"].items():
            # fp32 sums of the same terms in another order (the sequence split over 2 ranks)
            torch.testing.assert_close(r["sp"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    names = results[0]["marked"]
    assert any("final_layernorm" in n for n in names)
    assert any("k_layernorm" in n for n in names)
    if "linear_attention_layers" in arch_kw:
        assert any("out_norm" in n for n in names)
