"""Whole models on the SDPA core attention (:mod:`megatron_kd.integration.sdpa_attention`,
chosen on the CPU with ``build_gpt_model(attention="sdpa")``, a command's ``--attention-backend
sdpa``) against the same weights on Megatron-Core's
``DotProductAttention``: logits, loss and every parameter's gradient, for a dense GQA model, a
sliding-window one, a mixture of experts and a Gated DeltaNet hybrid (one gloo rank); and context
parallelism (2 gloo ranks) on ``ContextParallelSdpaAttention`` against the unfused model at CP 1.
"""

import contextlib

import pytest
import torch
from support.archs import tiny_arch

SEQ, BATCH = 16, 2

HYBRID = {"qk_layernorm": True, "linear_attention_layers": [0], "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_conv_kernel_dim": 4, "attention_output_gate": True}
ARCHS = {
    "dense": {"qk_layernorm": True},
    # blocks of the window's length (MIN_WINDOW_BLOCK lowered to 1 below): rows 0-5, 6-11, 12-15
    "sliding-window": {"window_size": 6, "window_layers": [0]},
    "moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16},
    "hybrid": HYBRID,
}


@contextlib.contextmanager
def _small_window_blocks():
    """Sliding windows in small query blocks (in this worker)."""
    from megatron_kd.integration import sdpa_attention

    saved = sdpa_attention.MIN_WINDOW_BLOCK
    sdpa_attention.MIN_WINDOW_BLOCK = 1
    try:
        yield
    finally:
        sdpa_attention.MIN_WINDOW_BLOCK = saved


def _core_attention_types(model) -> set[str]:
    return {type(m.core_attention).__name__ for m in model.modules()
            if hasattr(m, "core_attention")}


def case_model_parity(ctx, arch_kw):
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    arch = tiny_arch(max_position_embeddings=SEQ, **arch_kw)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    out, state = {}, None
    for choice in ("unfused", "sdpa"):
        with model_parallel(tp=1), _small_window_blocks():
            model = build_gpt_model(arch, seed=5, attention=choice)
            if state is None:
                state = {k: v.clone() for k, v in model.state_dict().items()
                         if isinstance(v, torch.Tensor)}
            else:
                model.load_state_dict(state, strict=False)
            with device_context():
                logits = model(tokens, pos, None)
                loss = model(tokens, pos, None, labels=labels).sum()
            loss.backward()
            out[choice] = {
                "types": _core_attention_types(model),
                "logits": logits.detach(),
                "loss": loss.detach(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None},
            }
    ref, got = out["unfused"], out["sdpa"]
    return {
        "types": (ref["types"], got["types"]),
        "logits_err": float((got["logits"] - ref["logits"]).abs().max()),
        "loss_err": float((got["loss"] - ref["loss"]).abs() / ref["loss"].abs()),
        "grad_names": (sorted(ref["grads"]), sorted(got["grads"])),
        "grad_errs": {n: float((got["grads"][n] - g).abs().max()
                               / g.abs().max().clamp_min(1e-12))
                      for n, g in ref["grads"].items()},
    }


@pytest.mark.parametrize("arch_kw", list(ARCHS.values()), ids=list(ARCHS))
def test_model_on_sdpa_equals_unfused(dist_pool_factory, arch_kw):
    (r,) = dist_pool_factory(1).run(case_model_parity, arch_kw)
    assert r["types"] == ({"DotProductAttention"}, {"SdpaAttention"})
    # fp32: the same model, its attention's softmax summed in another order
    assert r["logits_err"] < 1e-5
    assert r["loss_err"] < 1e-6
    assert r["grad_names"][0] == r["grad_names"][1]
    assert max(r["grad_errs"].values()) < 1e-5, r["grad_errs"]


def case_cp_parity(ctx, arch_kw):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_kd.integration.context_parallel import cp_positions
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel
    from megatron_kd.integration.output_layer import bypass_output_layer, to_sbh

    arch = tiny_arch(max_position_embeddings=SEQ, **arch_kw)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=g)
    weights = torch.randn(SEQ, BATCH, arch.hidden_size, generator=g)

    def run(model, positions):
        pos = positions.unsqueeze(0).expand(BATCH, -1)
        with device_context():
            hidden = to_sbh(model(tokens[:, positions], pos, None))  # [s/cp, b, h]
        return hidden, (hidden * weights[positions]).sum()

    with model_parallel(tp=1), _small_window_blocks():
        model = bypass_output_layer(build_gpt_model(arch, seed=5, attention="unfused"))
        state = {k: v.clone() for k, v in model.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        full, loss = run(model, torch.arange(SEQ))
        loss.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with model_parallel(cp=2), _small_window_blocks():
        # a summed loss, as the trainer's: DDP does not divide by the data x context ranks
        model = build_gpt_model(arch, seed=9, calculate_per_token_loss=True, attention="sdpa")
        model.load_state_dict(state, strict=False)
        bypass_output_layer(model)
        types = _core_attention_types(model)
        ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        positions = cp_positions(SEQ, ps.get_context_parallel_rank(), 2)
        hidden, loss = run(ddp, positions)
        loss.backward()
        finalize_model_grads([ddp])
        grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    return {"types": types,
            "hidden_err": float((hidden - full[positions]).abs().max()),
            "grad_errs": {n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                          for n, g in ref.items()}}


@pytest.mark.parametrize("arch_kw", [ARCHS["dense"], ARCHS["sliding-window"]],
                         ids=["causal", "sliding-window"])
def test_context_parallel_sdpa_equals_cp1(dist_pool_factory, arch_kw):
    for r in dist_pool_factory(2).run(case_cp_parity, arch_kw):
        assert r["types"] == {"ContextParallelSdpaAttention"}
        # fp32: the same sums, the softmax over keys in chunks and another order
        assert r["hidden_err"] < 1e-5
        assert max(r["grad_errs"].values()) < 1e-5, r["grad_errs"]
