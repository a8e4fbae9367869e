"""A Megatron-LM ``torch_dist`` checkpoint as the teacher, with no conversion.

A tiny random Llama from transformers is imported (``import-hf``), then written again the way
Megatron-LM's ``save_checkpoint`` lays a run out (``iter_0000007/`` of ``dist_checkpointing``
files with ``args``, ``checkpoint_version`` and ``iteration`` in the common state, and the
tracker file), without ``model_config.json``. Training against it with its architecture as
Megatron-LM flags (``--kd-teacher-args``, inline or a file), or read from its saved arguments,
gives exactly the losses of the imported checkpoint. A K = V cache built from it
(``cache build --kd-teacher-args``) and a replica serving it (``teacher serve
--kd-teacher-args``) give the colocated losses. The real Megatron-LM writer is exercised in
``test_megatron_lm_real.py`` (needs a Megatron-LM checkout).
"""

import os

import pytest
from support.hf_models import tiny_llama
from support.train_cases import (
    STUDENT,
    cache_build_argv,
    case_cache_build,
    case_import,
    case_train,
    step_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore")
pytest.importorskip("transformers")

# The tiny Llama in Megatron-LM's flags (its defaults: LayerNorm, learned positions, biases...
# are all overridden, as a Llama launch script does).
FLAGS = ("--num-layers 2 --hidden-size 48 --num-attention-heads 6 --group-query-attention "
         "--num-query-groups 2 --ffn-hidden-size 72 --max-position-embeddings 64 "
         "--position-embedding-type rope --rotary-base 5000 --normalization RMSNorm "
         "--norm-epsilon 1e-5 --swiglu --disable-bias-linear --vocab-size 500 "
         "--use-mcore-models --transformer-impl transformer_engine --seq-length 32 --bf16")
BASE = STUDENT + ["--train-iters", "3", "--eval-interval", "100", "--eval-iters", "0",
                  "--kd-ce-weight", "0.2"]


def case_write_megatron_lm_layout(ctx, ours, root, flags):
    """The imported weights in Megatron-LM's run layout (TP 2 shards, as a TP 2 run writes)."""
    import torch.distributed
    from megatron.core import dist_checkpointing

    from megatron_kd.arch.megatron_lm_args import parse_megatron_lm_flags
    from megatron_kd.integration.checkpoint import load_model_checkpoint, read_checkpoint_arch
    from megatron_kd.integration.cpu_shim import checkpoint_save_strategy
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    with model_parallel(tp=2):
        model = build_gpt_model(read_checkpoint_arch(ours), seed=1)
        load_model_checkpoint(model, ours)
        directory = os.path.join(root, "iter_0000007")
        if ctx.rank == 0:
            os.makedirs(directory)
        torch.distributed.barrier()
        state = {"model": model.sharded_state_dict(), "args": parse_megatron_lm_flags(flags),
                 "checkpoint_version": 3.0, "iteration": 7}
        dist_checkpointing.save(state, directory, sharded_strategy=checkpoint_save_strategy())
        if ctx.rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
        torch.distributed.barrier()


@pytest.fixture(scope="module")
def checkpoints(pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlm_teacher")
    hf_path, _, _ = tiny_llama(tmp, tied=True, vocab=500)
    ours, root = str(tmp / "imported"), str(tmp / "megatron_lm_run")
    pool.run(case_import, hf_path, ours)
    pool.run(case_write_megatron_lm_layout, ours, root, FLAGS)
    assert not os.path.exists(os.path.join(root, "iter_0000007", "model_config.json"))
    return ours, root


def test_megatron_lm_checkpoint_teacher_equals_the_import(pool, checkpoints, tmp_path):
    ours, root = checkpoints
    reference = step_losses(pool.run(case_train, BASE + ["--kd-teacher-load", ours])[0])
    flags_file = tmp_path / "teacher_args.txt"
    flags_file.write_text(FLAGS.replace(" --", " \\\n--") + "  # the teacher's MODEL_ARGS\n")
    for extra in (["--kd-teacher-args", FLAGS],  # flags inline
                  ["--kd-teacher-args", str(flags_file)],  # flags in a file
                  []):  # the arguments saved in the checkpoint
        got = pool.run(case_train, BASE + ["--kd-teacher-load", root] + extra)[0]
        # same weights, same model: bit-identical
        assert step_losses(got) == reference, extra
    assert all(v > 0.1 for v in reference)


def _cache_argv(out, teacher_root):
    return cache_build_argv(out, teacher_root, topk=500, seq=32, iters=3, global_batch=4, tp=2,
                            extra=("--kd-teacher-args", FLAGS))


def test_megatron_lm_checkpoint_teacher_offline_and_disaggregated(pool, checkpoints, replicas,
                                                                  tmp_path):
    ours, root = checkpoints
    reference = step_losses(pool.run(case_train, BASE + ["--kd-teacher-load", ours])[0])
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, root))
    offline = pool.run(case_train, BASE + ["--kd-mode", "offline", "--kd-topk-cache", cache])
    assert step_losses(offline[0]) == pytest.approx(reference, rel=5e-6)  # K = V, fp32
    replicas(root, tp=2, extra=("--kd-teacher-args", FLAGS))
    dis = pool.run(case_train, BASE + ["--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                                       str(tmp_path / "endpoint"), "--kd-teacher-load", root,
                                       "--kd-teacher-args", FLAGS])
    assert step_losses(dis[0]) == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("change, message", [
    (("--hidden-size 48", "--hidden-size 64"), "hidden_size=64"),
    (("--swiglu", "--swiglu --multi-latent-attention"), "multi_latent_attention"),
    (("--swiglu", "--swiglu --rotary-percent 0.5"), "rotary_percent=0.5"),
    (("--swiglu", "--swiglu --lr 1e-4"), r"not known as a model architecture: \['--lr'"),
])
def test_wrong_teacher_args_are_refused_before_any_step(checkpoints, change, message):
    from megatron_kd.integration.teacher import check_teacher

    _, root = checkpoints
    with pytest.raises(ValueError, match=message):
        check_teacher(root, seq_length=32, teacher_args=FLAGS.replace(*change))


def test_teacher_args_with_a_megatron_kd_checkpoint_are_refused(checkpoints):
    from megatron_kd.integration.teacher import check_teacher

    ours, _ = checkpoints
    with pytest.raises(ValueError, match="--kd-teacher-args is for Megatron-LM checkpoints"):
        check_teacher(ours, seq_length=32, teacher_args=FLAGS)
