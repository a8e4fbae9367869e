"""``tools/validate_planner.py`` accepts its built-in cases (every ``megatron-kd train`` mode) and
the package's run-to-plan adapter (``megatron_kd.commands.plan_adapter``) predicts what they
measure; no model is built and nothing trains (the runs themselves are
``python tools/validate_planner.py --builtin --run``, minutes on CPU).

The teacher checkpoint is its ``model_config.json`` alone: ``check_checkpoint_tensors`` (which
reads the dist_checkpointing metadata of a real checkpoint, covered by e2e/test_train.py) is
stubbed.
The offline cases' cache is real and complete: it is written with the spec that ``megatron-kd
cache build`` gets from the tool's own ``cache_build_argv``, so ``check_run`` checking it against
the run also checks that the tool builds the cache the run reads.
"""

import argparse
import dataclasses
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from megatron_kd.commands.plan_adapter import (
    parse_train_args,
    plan_options,
    predict,
    predict_teacher,
    resolve_run,
)
from megatron_kd.planner.memory import Term, total_bytes
from megatron_kd.planner.plan import Mode

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "validate_planner.py"
TOPK = 4  # a small K keeps the cache cheap to write; the built-in runs use BUILTIN_TOPK


@pytest.fixture(scope="module")
def vp():
    spec = importlib.util.spec_from_file_location("validate_planner", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def cases(vp, tmp_path, monkeypatch):
    # where the run's checks read the teacher's tensors
    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration import teacher as models

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    arch = GPTArchConfig(**vp._TEACHER_ARCH)
    (teacher / "model_config.json").write_text(
        json.dumps({"format_version": 1, "arch": arch.to_dict(), "extra": {}})
    )
    monkeypatch.setattr(models, "check_checkpoint_tensors", lambda directory, arch=None: arch)
    cache = tmp_path / "cache"
    built = vp.builtin_cases(str(teacher), str(cache), str(tmp_path / "endpoint"))
    offline = [c for c in built if "--kd-topk-cache" in c.train_args]
    assert offline, "the built-in cases must include an offline run"
    _write_cache(vp, offline[0], str(cache), str(teacher), arch.vocab_size)
    return built


def _write_cache(vp, case, cache_dir, teacher_dir, vocab_size):
    """A complete cache with the spec `megatron-kd cache build` would record for this argv."""
    from megatron_kd.cache.format import CacheSpec, token_fingerprint
    from megatron_kd.cache.identity import dataset_identity, tokenizer_identity
    from megatron_kd.cache.writer import CacheWriter
    from megatron_kd.commands.cache import add_arguments
    from megatron_kd.data.datasets import MockGPTDataset
    from megatron_kd.data.tokenizer import MockTokenizer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = vp.cache_build_argv(case.train_args, case.nproc, cache_dir, teacher_dir, TOPK)
    args = parser.parse_args(["build", *argv])
    assert args.mock_data, "the built-in offline cases use --mock-data"
    samples = args.train_iters * args.global_batch_size
    dataset = MockGPTDataset(
        vocab_size=vocab_size, seq_length=args.seq_length, num_samples=samples, seed=args.seed
    )
    spec = CacheSpec(
        teacher_checkpoint=teacher_dir,
        teacher_weights_hash="0" * 64,
        tokenizer=tokenizer_identity(MockTokenizer(vocab_size)),
        vocab_size=vocab_size,
        topk=args.kd_topk,
        seq_length=args.seq_length,
        num_samples=samples,
        dataset_hash=dataset_identity(dataset),
        samples_per_shard=samples,
    )
    writer = CacheWriter(cache_dir, spec)
    ids = np.broadcast_to(np.arange(TOPK), (args.seq_length, TOPK))
    logprobs = np.full((args.seq_length, TOPK), -np.log(TOPK), dtype=np.float32)
    writer.write_shard(0, [writer.encode(ids, logprobs)] * samples,
                       [token_fingerprint(dataset[i]["tokens"]) for i in range(samples)])


def test_builtin_cases_cover_every_mode(vp, cases):
    from megatron_kd.modes.args import KD_MODES

    modes = {parse_train_args(c.train_args).kd_mode for c in cases}
    assert modes == set(KD_MODES)


def test_builtin_disaggregated_cases_have_a_replica(vp, cases, tmp_path):
    disagg = [c for c in cases if parse_train_args(c.train_args).kd_mode == "disaggregated"]
    assert [(c.name, c.nproc) for c in disagg] == [
        ("disagg tp1 b4 s512", 1),
        ("disagg tp2 b2 s512", 2),
        ("disagg cp2 b1 s1024", 2),
        ("disagg cp2 b1 s4096", 2),
    ]
    for case in disagg:
        # the student's world is its own ranks only; the replica is a world of its own
        assert "--kd-teacher-world-size" not in case.train_args
        assert f"--kd-teacher-endpoint {tmp_path / 'endpoint'}" in case.train_args
        assert case.teacher_args is not None and case.teacher_nproc == 1
        argv = vp.teacher_serve_argv(parse_train_args(case.train_args), case.teacher_args)
        assert argv[0] == "serve" and "--kd-teacher-world-size" not in argv


def test_teacher_serve_args_are_checked(vp, cases):
    case = next(c for c in cases if c.teacher_args is not None)
    with pytest.raises(ValueError, match="teacher_nproc=2"):
        vp.teacher_serve_args(dataclasses.replace(case, teacher_nproc=2))
    two = dataclasses.replace(
        case, teacher_args=case.teacher_args + " --tensor-model-parallel-size 2", teacher_nproc=2
    )
    assert vp.teacher_serve_args(two).tensor_model_parallel_size == 2
    with pytest.raises(ValueError, match="--kd-teacher-dtype 'bf16' is not the student's"):
        vp.teacher_serve_args(
            dataclasses.replace(
                case, teacher_args=case.teacher_args + " --kd-teacher-dtype bf16"
            )
        )
    with pytest.raises(ValueError, match="--kd-teacher-load 'elsewhere' is not the student's"):
        vp.teacher_serve_args(
            dataclasses.replace(
                case, teacher_args=case.teacher_args + " --kd-teacher-load elsewhere"
            )
        )
    colocated = next(c for c in cases if c.teacher_args is None)
    with pytest.raises(ValueError, match="no teacher replica"):
        vp.teacher_serve_args(colocated)
    # a disaggregated --run without its replica's flags is refused before anything starts
    with pytest.raises(ValueError, match="needs its teacher replica's serve flags"):
        vp.run_case(dataclasses.replace(case, teacher_args=None), "x.jsonl", "peaks", "tpeaks")


def test_builtin_cases_resolve_and_predict(vp, cases, tmp_path):
    def tmp_endpoint(case):
        return tmp_path / "endpoint"

    gib = 1 << 30
    for case in cases:
        config, run = resolve_run(case.train_args, case.nproc)
        # the teacher: h_t=768, V=32000, fp32; G sequences of s tokens, dp = 1 in every case
        gbs, seq = config.data.global_batch_size, config.data.seq_length
        wire_per_dp_rank = gbs * seq * 768 * 4  # G/dp * s * h_t * 4 bytes
        ids_per_dp_rank = gbs * seq * 4  # G/dp * s token ids of 4 bytes
        pred = predict(config, run, on_cpu=True)
        total = total_bytes(pred.terms)
        # well above the ~0.35 GiB framework baseline, as the tool's docstring asks
        assert total > 0.5 * gib, (case.name, total)
        assert Term.RESERVE not in pred.terms
        if run.kd.mode != "disaggregated":
            assert case.teacher_args is None and pred.wire is None
            assert pred.wire_to_teacher is None
        if run.kd.mode == "colocated":
            assert pred.mode is Mode.COLOCATED_FUSED and Term.TEACHER_WEIGHTS in pred.terms
        elif run.kd.mode == "offline":
            assert pred.mode is Mode.OFFLINE_CACHE and run.topk_cache.spec.topk == TOPK
            # CPU: D=2 queued + 1 decoding + 1 in use, b*s tokens, K entries of 12 bytes
            b = config.optimizer.micro_batch_size
            assert pred.terms[Term.CACHE_READER] == 4 * b * 512 * TOPK * 12
            assert Term.TEACHER_WEIGHTS not in pred.terms
        else:
            assert pred.mode is Mode.DISAGGREGATED
            # the wire is the teacher's dtype (fp32: no --kd-wire-dtype)
            assert run.kd.wire == "fp32"
            # a student rank receives 1/tp of its context-parallel rank's s/cp positions
            assert pred.wire == {
                "dp-rank": wire_per_dp_rank,
                "tp-rank": wire_per_dp_rank / (run.layout.tp * run.layout.cp),
                "all-ranks": wire_per_dp_rank,
            }
            # kd_wire_bytes_to_teacher sums the student's ranks: dp x (G/dp * s * 4), dp = 1
            assert pred.wire_to_teacher == {
                "dp-rank": ids_per_dp_rank,
                "all-ranks": ids_per_dp_rank,
            }
            # the student's copy of the teacher output-layer shard: V/t * h_t * 4 bytes
            assert pred.terms[Term.TEACHER_OUTPUT_SHARD] == 32000 // run.layout.tp * 768 * 4
            # one replica of one rank, outside the student's world, at the student's endpoint
            assert config.kd.teacher_endpoint == str(tmp_endpoint(case))
            assert case.teacher_nproc == 1
            serve = vp.teacher_serve_args(case)
            assert (serve.tensor_model_parallel_size, serve.pipeline_model_parallel_size) == (1, 1)
            assert serve.kd_teacher_load == config.kd.teacher_load
            assert serve.kd_teacher_endpoint == config.kd.teacher_endpoint
            assert serve.host == "127.0.0.1"
            teacher = predict_teacher(config, run, True, 1, 1)
            # the replica loads its (untied) output layer too: V * h_t * 4 bytes
            assert teacher[Term.REPLICA_OUTPUT_LAYER] == 32000 * 768 * 4
            # its D = 2 send slots: whole micro-batches (replica TP 1), fp32 on the wire
            b = config.optimizer.micro_batch_size
            assert teacher[Term.SEND_SLOTS] == 2 * seq * b * 768 * 4
            assert Term.RESERVE not in teacher


def test_the_loss_path_is_the_runs(cases):
    """The planner models the fused loss's path the run takes: ``--kd-loss-path auto`` is the GPU
    path on a GPU (with the run's window budget and accumulator), the CPU path on CPU."""
    case = next(c for c in cases if c.teacher_args is None and "--kd-topk-cache" not in
                c.train_args)
    gpu_flags = " --kd-loss-window-mib 1.5 --kd-loss-weight-grad input_dtype"
    config, run = resolve_run(case.train_args + gpu_flags, case.nproc)
    on_gpu = plan_options(config, run, on_cpu=False)
    assert (on_gpu.loss_path, on_gpu.loss_window_bytes, on_gpu.loss_weight_grad) == (
        "gpu", 3 << 19, "input_dtype")
    assert plan_options(config, run, on_cpu=True).gpu_loss is None
    config, run = resolve_run(case.train_args + " --kd-loss-path gpu", case.nproc)
    forced = plan_options(config, run, on_cpu=True)
    assert (forced.loss_path, forced.loss_window_bytes, forced.loss_weight_grad) == (
        "gpu", 1 << 30, "fp32_gemm")


def test_rows_and_table(vp, cases):
    case = next(c for c in cases if "disaggregated" in c.train_args)
    config, run = resolve_run(case.train_args, case.nproc)
    pred = predict(config, run, on_cpu=True)
    baseline = 1 << 28
    # literal terms with both exclusive phases (a colocated teacher's forward, the unfused
    # attention backward): predicted 6 + max(0.5, 1) = 7 x 2^28, not their sum 7.5 x 2^28
    terms = {Term.ACTIVATIONS: 5 << 28, Term.RING_SLOTS: 1 << 28,
             Term.TEACHER_FORWARD: 1 << 27, Term.ATTENTION_BACKWARD: 1 << 28}
    row = vp._memory_row(case.name, pred.mode, "cpu_max_rss", terms, 1 << 31, baseline, True)
    # ratio = predicted / (measured - baseline) = 7 x 2^28 / (8 x 2^28 - 2^28)
    assert (row["predicted_bytes"], row["ratio"], row["memory_ok"]) == (7 << 28, 1.0, True)
    assert row["ratio_absolute"] == 1.0  # (7 + 1) x 2^28 / 8 x 2^28
    row = vp._memory_row(case.name, pred.mode, "cpu_max_rss", pred.terms, 1 << 31, baseline, True)
    row.update(
        wire_predicted=pred.wire["dp-rank"],
        wire_counted=[6291456],
        wire_to_teacher_predicted=pred.wire_to_teacher["all-ranks"],
        wire_to_teacher_counted=[8192],
        wire_ok=True,
    )
    table = vp.format_rows([row], with_terms=True)
    assert case.name in table and "equal (to student 6291456, to teacher 8192 B/step)" in table
    assert "ring slots (D x 1/t seq)" in table


def _write_run(tmp_path, name, steps, teacher_peak):
    log = tmp_path / f"{name}.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in steps))
    peaks = tmp_path / f"{name}.teacher_peaks"
    peaks.mkdir()
    (peaks / "rank0.json").write_text(json.dumps({"peak_rss_bytes": teacher_peak}))
    return str(log), str(peaks)


def test_compare_disaggregated_run(vp, cases, tmp_path):
    """Both directions of the wire compared exactly, and the replica's rank-0 row."""
    case = next(c for c in cases if c.name == "disagg tp2 b2 s512")
    hidden, ids = 4 * 512 * 768 * 4, 4 * 512 * 4  # dp = 1: per DP rank = all ranks
    step = {
        "peak_mem_kind": "cpu_max_rss",
        "peak_mem_bytes": 3 << 30,
        "kd_wire_bytes": hidden,
        "kd_wire_bytes_per_dp_rank": hidden,
        "kd_wire_bytes_to_teacher": ids,
    }
    baseline = 1 << 28
    log, peaks = _write_run(tmp_path, "ok", [dict(step, step=1), dict(step, step=2)], 2 << 30)
    run = dataclasses.replace(case, log_json=log, teacher_peak_dir=peaks)
    rows = vp.compare(run, baseline, "kd_wire_bytes_per_dp_rank", "dp-rank")
    assert [r["mode"] for r in rows] == ["disaggregated", "disagg teacher"]
    assert rows[0]["wire_ok"] and rows[0]["wire_counted"] == [hidden]
    assert rows[0]["wire_to_teacher_predicted"] == ids
    assert rows[0]["wire_to_teacher_counted"] == [ids]
    assert vp.compare(run, baseline, "kd_wire_bytes", "all-ranks")[0]["wire_ok"]
    teacher = rows[1]
    # the replica's rank 0 by hand (the tool's teacher: 6 layers, h 768, a 12, g 4, d 64,
    # f 2048 SwiGLU, V 32000 untied; fp32 on CPU, unfused attention; b 2, s 512, D 2):
    # parameters 6 x (589,824 Q + 393,216 K V + 589,824 O + 4,718,592 MLP + 1,536 norms)
    # + 2 x 24,576,000 (embedding, output layer) + 768 = 86,910,720, 4 bytes each
    assert teacher["terms"] == {
        Term.REPLICA_WEIGHTS: (86_910_720 - 32000 * 768) * 4,
        Term.REPLICA_OUTPUT_LAYER: 32000 * 768 * 4,
        # one no-grad layer over n = 1024 tokens: (4h + max(mixer 4,096, MLP 6f 12,288)) x 2
        # (fp32), + the unfused scores and probabilities 2 x b x a x s x s x 4 bytes
        Term.TEACHER_FORWARD: 1024 * (4 * 768 + 6 * 2048) * 2 + 2 * 2 * 12 * 512 * 512 * 4,
        Term.SEND_SLOTS: 2 * 512 * 2 * 768 * 4,
    }
    assert teacher["measured_bytes"] == 2 << 30 and teacher["kind"].endswith("(tp1 pp1)")
    # 435,723,264 predicted over the measured peak less the baseline
    assert teacher["ratio"] == 435_723_264 / ((2 << 30) - baseline)
    # no teacher row without the replica's flags (its layout is not known)
    assert (
        len(
            vp.compare(
                dataclasses.replace(run, teacher_args=None),
                baseline,
                "kd_wire_bytes_per_dp_rank",
                "dp-rank",
            )
        )
        == 1
    )
    # one token id byte off in one step: the wire differs
    off = dict(step, step=2, kd_wire_bytes_to_teacher=ids + 4)
    log, peaks = _write_run(tmp_path, "off", [dict(step, step=1), off], 2 << 30)
    rows = vp.compare(
        dataclasses.replace(run, log_json=log, teacher_peak_dir=peaks),
        baseline,
        "kd_wire_bytes_per_dp_rank",
        "dp-rank",
    )
    assert not rows[0]["wire_ok"] and rows[0]["wire_to_teacher_counted"] == [ids, ids + 4]
    assert "DIFFERS" in vp.format_rows(rows)
    # the hidden states' scope: kd_wire_bytes_per_dp_rank is not the tp-rank share
    assert not vp.compare(run, baseline, "kd_wire_bytes_per_dp_rank", "tp-rank")[0]["wire_ok"]
    # a disaggregated log without the token-id bytes is refused
    missing = {k: v for k, v in step.items() if k != "kd_wire_bytes_to_teacher"}
    log, peaks = _write_run(tmp_path, "missing", [dict(missing, step=1)], 2 << 30)
    with pytest.raises(ValueError, match="kd_wire_bytes_to_teacher"):
        vp.compare(
            dataclasses.replace(run, log_json=log),
            baseline,
            "kd_wire_bytes_per_dp_rank",
            "dp-rank",
        )


def test_teacher_dtype_mismatch_is_refused(vp, cases):
    case = next(c for c in cases if "colocated" in parse_train_args(c.train_args).kd_mode)
    config, run = resolve_run(case.train_args + " --kd-teacher-dtype bf16", case.nproc)
    with pytest.raises(ValueError, match="--kd-teacher-dtype bf16 with fp32"):
        predict(config, run, on_cpu=True)


def test_context_parallel_cases_halve_a_ranks_share(vp, cases):
    """CP 2 against the same run at CP 1 on one rank: each rank holds half of each sequence
    (its activations less than 0.6x, its share of the hidden states exactly 0.5x)."""
    for case in (c for c in cases if "--context-parallel-size 2" in c.train_args):
        split = predict(*resolve_run(case.train_args, 2), on_cpu=True)
        whole = predict(*resolve_run(case.train_args.replace(
            "--context-parallel-size 2", "--context-parallel-size 1"), 1), on_cpu=True)
        assert split.terms[Term.ACTIVATIONS] < 0.6 * whole.terms[Term.ACTIVATIONS], case.name
        # the unfused attention's backward: [heads, s/cp, s] scores
        assert split.terms[Term.ATTENTION_BACKWARD] == whole.terms[Term.ATTENTION_BACKWARD] / 2
        if split.wire is not None:
            assert split.wire["tp-rank"] == whole.wire["tp-rank"] / 2
            assert split.wire["all-ranks"] == whole.wire["all-ranks"]
            assert split.wire_to_teacher == whole.wire_to_teacher  # tokens go once a sequence


def test_only_selects_builtin_cases_before_anything_runs(vp, monkeypatch, capsys, tmp_path):
    """``--only`` keeps the built-in cases whose names hold one of its words; a word no case has
    is refused before a teacher is made or a run starts."""
    monkeypatch.setattr(vp.tempfile, "mkdtemp", lambda prefix: str(tmp_path))  # no leftover
    made = []
    monkeypatch.setattr(vp, "make_random_teacher", lambda *a, **k: made.append(a))
    with pytest.raises(SystemExit):
        vp.main(["--builtin", "--run", "--only", "cp3"])
    assert "--only cp3: no built-in case's name has them" in capsys.readouterr().err
    assert made == []
    names = [name for name, *_ in vp.BUILTIN_CASES]
    assert [n for n in names if "cp2" in n] == [
        "colocated cp2 b1 s1024", "colocated cp2 b1 s4096",
        "disagg cp2 b1 s1024", "disagg cp2 b1 s4096",
    ]
