"""Every command places its models and tensors as a GPU run must, checked on CPU.

Each run below is a real command (``megatron-kd train`` in each teacher mode and layout,
``cache build``, ``teacher serve``, ``import-hf``, ``export-hf``) run inside the simulated
accelerator (:mod:`megatron_kd.testing.devices`): "CUDA" tensors are tagged host tensors, the
backend answers ``nccl``, and what a GPU refuses is refused -- an op mixing accelerator and host
tensors raises naming its ``file:line``, a collective given a host tensor raises, and a model
left with a host parameter or buffer fails the check every command runs after building it.
Before models were moved to their device, every one of these failed in the first forward
(torch's norms are built on the host), as ``megatron-kd train`` and ``cache build`` did on the
first H200 they met.

The simulation changes where tensors claim to live, never what is computed: the colocated run's
losses equal the same run's without it, bit for bit.
"""

import os

import pytest
from support.hf_models import tiny_qwen3
from support.train_cases import (
    cache_build_argv,
    case_import,
    case_train,
    step_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore")

RUN = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
       "--train-iters", "2", "--mock-data", "--no-progress", "--lr", "1e-2",
       "--lr-warmup-iters", "1", "--eval-iters", "0", "--kd-ce-weight", "0.2",
       # "CUDA" tensors take the loss's GPU path; their data is on the host: its eager kernels
       "--kd-loss-gpu-kernels", "eager"]


@pytest.fixture(scope="module")
def student(pool, tmp_path_factory):
    """A tiny 4-layer Qwen3 imported under the simulation (``import-hf`` from a GPU): every
    run starts from its weights (a GPU initialises weights with other random streams than the
    CPU, so runs from random weights could not be compared)."""
    tmp = tmp_path_factory.mktemp("placement")
    hf_path, _, _ = tiny_qwen3(tmp / "hf", vocab=500, layers=4)
    imported = str(tmp / "imported")
    pool.run(_simulated, case_import, hf_path, imported)
    return imported


def _simulated(ctx, case, *args):
    """``case(ctx, *args)`` inside the simulated accelerator; returns its result and how many
    checked ``torch.distributed`` calls ran (each saw only accelerator tensors)."""
    from megatron_kd.testing.devices import simulated_accelerator

    with simulated_accelerator() as calls:
        result = case(ctx, *args)
    return result, len(calls)


def _cli(ctx, argv):
    from megatron_kd.cli import main

    assert main(argv) == 0
    return True


def _first_rank_cli(ctx, argv):
    """A single-process command (``export-hf``) on rank 0 alone."""
    return _cli(ctx, argv) if ctx.rank == 0 else True


def _train(pool, argv):
    results = pool.run(_simulated, case_train, argv)
    for _, checked in results:
        assert checked > 0  # the step's collectives ran under the check
    losses = step_losses(results[0][0])
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses), losses
    return losses


def test_colocated_losses_unchanged_by_the_simulation(pool, teacher, student):
    argv = RUN + ["--pretrained-checkpoint", student, "--kd-teacher-load", teacher,
                  "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    simulated = _train(pool, argv)
    # the same loss path on the host: the GPU path, which "CUDA" tensors take
    assert simulated == step_losses(pool.run(case_train, argv + ["--kd-loss-path", "gpu"])[0])


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
    ["--context-parallel-size", "2"],
], ids=["pp2-vp2", "cp2"])
def test_colocated_layouts(pool, teacher, student, layout):
    _train(pool, RUN + ["--pretrained-checkpoint", student, "--kd-teacher-load", teacher,
                        *layout])


def test_cache_build_and_offline_training(pool, teacher, student, tmp_path):
    cache = tmp_path / "cache"
    argv = cache_build_argv(cache, teacher, topk=8, seq=32, iters=2, global_batch=4, tp=2)
    assert [ok for ok, _ in pool.run(_simulated, _cli, argv)] == [True, True]
    _train(pool, RUN + ["--pretrained-checkpoint", student, "--kd-mode", "offline",
                        "--kd-topk-cache", str(cache), "--tensor-model-parallel-size", "2"])


def test_disaggregated_with_a_simulated_replica(pool, teacher, student, replicas, tmp_path):
    # the replica is a `megatron-kd teacher serve` process, run inside the simulation too
    replica = replicas(teacher, simulate=True)
    _train(pool, RUN + ["--pretrained-checkpoint", student, "--kd-teacher-load", teacher,
                        "--kd-mode", "disaggregated",
                        "--kd-teacher-endpoint", str(tmp_path / "endpoint")])
    replica.stop()
    assert replica.final_stats()["tokens"] == 2 * 4 * 32  # it served every sample of the run


def test_train_then_export(pool, teacher, student, tmp_path):
    run = str(tmp_path / "run")
    _train(pool, RUN + ["--pretrained-checkpoint", student, "--kd-teacher-load", teacher,
                        "--save", run])
    out = str(tmp_path / "exported")
    pool.run(_simulated, _first_rank_cli, ["export-hf", "--load", run, "--save", out])
    assert os.path.exists(os.path.join(out, "config.json"))
