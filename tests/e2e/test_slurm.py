"""The sbatch scripts of ``examples/slurm/`` on a real Slurm: munged, slurmctld and two slurmd
"nodes" on localhost (see ``support/slurm_fixture.py``), each script submitted with a tiny CPU run.

Tiers, cheapest first:

* the launcher alone: ``disaggregated.sbatch`` with a stand-in program (``KD_PYTHON``) that joins
  the ``torch.distributed`` world from the variables the script sets and reports every rank's
  place -- the rank split on one node and across two nodes, a failed step failing the job, a bad
  split refused;
* the real program: ``colocated.sbatch`` and ``cache_build.sbatch`` running ``megatron-kd train``
  / ``megatron-kd cache build`` on a tiny random teacher (2 layers, hidden 32) over ``--mock-data``,
  checked by job state (``scontrol show job``: COMPLETED, exit 0:0) and by their JSON logs;
  ``disaggregated.sbatch`` likewise once the program accepts ``--kd-mode disaggregated`` (asked
  at test time; skipped until then).

Skipped, with the reason, where the daemons cannot start (under CI, ``CI=true``, failed instead:
``tests/support/skips.py``; no ``slurm-wlm``/``munge``: see
``.ci/slurm_setup.sh``; not root). The daemons are stopped by PID at the end of the module.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.slurm_fixture import LocalSlurm, SlurmUnavailable

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "slurm"

# Generous: every job starts Python, torch and megatron-core in each rank, on a CI machine that
# may have 2 cores for 4 ranks.
JOB_TIMEOUT_S = 600
TRAIN_ITERS = 3

# The tiny student (as support/train_cases.py's) and a tiny teacher with the same vocabulary.
TEACHER_ARCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=64, vocab_size=500, padded_vocab_size=512,
                    max_position_embeddings=64, tie_embeddings=True)
STUDENT_FLAGS = """
    # a tiny CPU run
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
    --ffn-hidden-size 64 --seq-length 32 --micro-batch-size 2 --global-batch-size 4
    --train-iters {iters} --eval-interval {iters} --eval-iters 1 --lr 1e-2 --mock-data
    --kd-teacher-load {teacher} --kd-ce-weight 0.2
"""
CACHE_FLAGS = """
    --kd-teacher-load {teacher} --kd-topk 8 --seq-length 32 --micro-batch-size 2
    --train-iters {iters} --global-batch-size 4 --eval-iters 1 --mock-data --samples-per-shard 4
"""
# Every job: no GPU requested (the #SBATCH default asks for 8), a short limit, CPU mode.
CPU_JOB = ("--gpus-per-node=0", "--time=10")


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(request):
    cluster = LocalSlurm(nodes=2, cpus=4)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.cleanup()
        reason = f"cannot start a local Slurm: {e}"
        # Printed past the output capture, so that a plain `pytest -q` run says why.
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"\ntests/test_slurm.py skipped: {reason}")
        pytest.skip(reason)
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture(scope="module")
def teacher_ckpt(tmp_path_factory):
    """A tiny random teacher checkpoint (one process, a world of one)."""
    directory = tmp_path_factory.mktemp("teacher") / "ckpt"
    code = textwrap.dedent(f"""
        import torch.distributed as dist
        from megatron_kd.arch import GPTArchConfig
        from megatron_kd.integration.gpt import build_gpt_model
        from megatron_kd.integration.checkpoint import save_model_checkpoint
        from megatron_kd.integration.groups import init_distributed_from_env, model_parallel
        arch = GPTArchConfig(**{TEACHER_ARCH!r})
        init_distributed_from_env()
        with model_parallel():
            save_model_checkpoint(build_gpt_model(arch, seed=5), arch, {str(directory)!r})
        dist.destroy_process_group()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK",
                                                                      "WORLD_SIZE"))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(directory)


def _args_file(path: Path, template: str, **values) -> Path:
    path.write_text(textwrap.dedent(template.format(**values)))
    return path


def _submit(slurm: LocalSlurm, script: str, tmp_path: Path, *options: str, **env: str):
    """Submit ``examples/slurm/<script>`` from ``tmp_path`` in CPU mode; wait; return
    ``(job info, log dir, job output text)``."""
    log_dir = tmp_path / "logs"
    # sbatch passes our environment on: none of the caller's own KD_* settings.
    job_env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KD_")}
    job_env |= {"KD_USE_CPU": "1", "KD_LOG_DIR": str(log_dir), "KD_PYTHON": sys.executable,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))}
    job_env.update(env)
    out = tmp_path / "job.out"
    job_id = slurm.sbatch(SCRIPTS / script, *CPU_JOB, f"--output={out}", *options,
                          cwd=tmp_path, env=job_env)
    t0 = time.monotonic()
    info = slurm.wait(job_id, timeout_s=JOB_TIMEOUT_S)
    info["_wall_s"] = f"{time.monotonic() - t0:.1f}"
    text = out.read_text(errors="replace") if out.exists() else "(no job output)"
    return info, log_dir, text


def _submit_nowait(slurm: LocalSlurm, script: str, tmp_path: Path, *options: str, **env: str):
    """As :func:`_submit`, without waiting: ``(job id, log dir, job output path)``."""
    log_dir = tmp_path / "logs"
    job_env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KD_")}
    job_env |= {"KD_USE_CPU": "1", "KD_LOG_DIR": str(log_dir), "KD_PYTHON": sys.executable,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))}
    job_env.update(env)
    out = tmp_path / "job.out"
    job_id = slurm.sbatch(SCRIPTS / script, *CPU_JOB, f"--output={out}", *options,
                          cwd=tmp_path, env=job_env)
    return job_id, log_dir, out


def _explain(info: dict, log_dir: Path, text: str) -> str:
    """Job state, the tail of its output and of each step log: the assertion message."""
    state = (f"JobState={info.get('JobState')} ExitCode={info.get('ExitCode')} "
             f"Reason={info.get('Reason')}")
    parts = [state, "--- job output (tail)", text[-4000:]]
    for log in sorted(log_dir.glob("*.log")) if log_dir.exists() else []:
        parts += [f"--- {log.name} (tail)", log.read_text(errors="replace")[-3000:]]
    return "\n".join(parts)


def _assert_completed(info: dict, log_dir: Path, text: str) -> None:
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), \
        _explain(info, log_dir, text)


def _launch_line(text: str, job_id: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(f"megatron-kd[{job_id}]: ")]
    assert lines, f"no launcher line in the job output:\n{text[-2000:]}"
    return lines[0]


def _check_train_log(log_dir: Path, info, text, iters: int = TRAIN_ITERS) -> list[dict]:
    path = log_dir / "train.jsonl"
    assert path.exists(), _explain(info, log_dir, text)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in steps] == list(range(1, iters + 1))
    for r in steps:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["kd_loss"] is not None and r["lm_loss"] is not None  # teacher and labels used
        assert r["tokens_per_s"] > 0
    assert [e["step"] for e in evals] == [iters]
    return steps


# --- the launcher, with a stand-in program ------------------------------------------------------

# Joins its step's world from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (as the real program does,
# over gloo) and has rank 0 write every rank's view to its --log-json path: `teacher serve`
# (a service: it then waits for SIGTERM) and `train` (it then exits). With STUB_FAIL=1 the
# teacher exits 3 at once and the student waits (as a real one would, for a replica).
STUB = """
import datetime, json, os, signal, sys, time

argv = sys.argv[1:]
serving = argv[:2] == ["teacher", "serve"]
if os.environ.get("STUB_FAIL") == "1":
    if serving:
        sys.exit(3)
    time.sleep(300)
    sys.exit(0)
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID",
        "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES")
me = {k: os.environ.get(k) for k in keys}
me["argv"] = argv
views = [None] * dist.get_world_size()
dist.all_gather_object(views, me)
if dist.get_rank() == 0:
    with open(argv[argv.index("--log-json") + 1], "w") as f:
        json.dump(views, f)
dist.destroy_process_group()
if serving:  # a service runs until stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(1)
"""


@pytest.fixture(scope="module")
def stub_python(tmp_path_factory):
    """A ``KD_PYTHON`` that runs the stand-in instead of ``-m megatron_kd``."""
    d = tmp_path_factory.mktemp("stub")
    (d / "stub.py").write_text(STUB)
    wrapper = d / "python"
    # Called as `$KD_PYTHON -m megatron_kd COMMAND ARGS...`: drop `-m megatron_kd`.
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{d / "stub.py"}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _job_port(job_id) -> int:
    """kd_env.sh's rendezvous port of a job: 8 ports a job, from 15000 (written out here, not
    read from the script)."""
    return 15000 + 8 * (int(job_id) % 1875)


def _views(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def _check_worlds(log_dir: Path, *, students, teachers, job_id):
    """Two steps, two worlds: each its ranks 0.., its own rendezvous; the student told the
    endpoint, the teacher serving it."""
    student, teacher = _views(log_dir / "train.jsonl"), _views(log_dir / "teacher.jsonl")
    for views, world in ((student, students), (teacher, teachers)):
        assert [int(v["RANK"]) for v in views] == list(range(world))
        assert {v["WORLD_SIZE"] for v in views} == {str(world)}
        assert len({v["SLURM_STEP_ID"] for v in views}) == 1
        assert {v["CUDA_VISIBLE_DEVICES"] for v in views} == {""}  # KD_USE_CPU=1
    assert student[0]["SLURM_STEP_ID"] != teacher[0]["SLURM_STEP_ID"]
    port = _job_port(job_id)
    assert {v["MASTER_PORT"] for v in student} == {str(port)}
    assert {v["MASTER_PORT"] for v in teacher} == {str(port + 1)}
    endpoint = str(log_dir / "teacher-endpoint")
    for v in student:
        a = v["argv"]
        assert a[a.index("--kd-mode") + 1] == "disaggregated"
        assert a[a.index("--kd-teacher-endpoint") + 1] == endpoint
    for v in teacher:
        a = v["argv"]
        assert a[:2] == ["teacher", "serve"]
        assert a[a.index("--kd-teacher-endpoint") + 1] == endpoint
    # Local ranks are unique per node (one GPU each).
    per_node: dict[str, list[int]] = {}
    for v in student + teacher:
        per_node.setdefault(v["SLURMD_NODENAME"], []).append(int(v["LOCAL_RANK"]))
    for node, local in per_node.items():
        assert sorted(local) == list(range(len(local))), (node, local)
    return student, teacher


def test_disaggregated_split_one_node(slurm, stub_python, tmp_path):
    args = _args_file(tmp_path / "train.args", STUDENT_FLAGS, iters=1, teacher="/nonexistent")
    info, log_dir, text = _submit(slurm, "disaggregated.sbatch", tmp_path, "--nodes=1",
                                  f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=3",
                                  KD_PYTHON=stub_python, KD_ARGS_FILE=str(args),
                                  KD_TEACHER_TASKS="1")
    _assert_completed(info, log_dir, text)
    student, teacher = _check_worlds(log_dir, students=2, teachers=1, job_id=info["JobId"])
    assert {v["SLURMD_NODENAME"] for v in student + teacher} == {slurm.nodes[0]}
    assert [v["LOCAL_RANK"] for v in teacher] == ["2"]  # after the students' 0, 1
    node = slurm.nodes[0]
    assert f"teacher: 1 rank(s) on {node}; student: 2 rank(s) on {node}" in text, text[-2000:]


def test_disaggregated_split_two_nodes(slurm, stub_python, tmp_path):
    args = _args_file(tmp_path / "train.args", STUDENT_FLAGS, iters=1, teacher="/nonexistent")
    info, log_dir, text = _submit(slurm, "disaggregated.sbatch", tmp_path, "--nodes=2",
                                  "--ntasks-per-node=2", KD_PYTHON=stub_python,
                                  KD_ARGS_FILE=str(args), KD_TEACHER_NODES="1")
    _assert_completed(info, log_dir, text)
    student, teacher = _check_worlds(log_dir, students=2, teachers=2, job_id=info["JobId"])
    # Student on the first node, teacher on the last; nothing shared.
    assert {v["SLURMD_NODENAME"] for v in student} == {slurm.nodes[0]}
    assert {v["SLURMD_NODENAME"] for v in teacher} == {slurm.nodes[1]}
    ta = teacher[0]["argv"]  # the default teacher layout: TP over a node's tasks, PP over nodes
    assert ta[ta.index("--tensor-model-parallel-size") + 1] == "2"
    assert ta[ta.index("--pipeline-model-parallel-size") + 1] == "1"


def test_disaggregated_failed_teacher_step_fails_job(slurm, stub_python, tmp_path):
    """A teacher step that exits 3 fails the job with exit 3, and the waiting student is
    stopped (not left to wait for a replica)."""
    args = _args_file(tmp_path / "train.args", STUDENT_FLAGS, iters=1, teacher="/nonexistent")
    info, log_dir, text = _submit(slurm, "disaggregated.sbatch", tmp_path, "--nodes=1",
                                  f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=3",
                                  KD_PYTHON=stub_python, KD_ARGS_FILE=str(args),
                                  KD_TEACHER_TASKS="1", STUB_FAIL="1")
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0"), _explain(info, log_dir, text)
    assert "teacher step failed (exit 3): stopping the student step" in text
    assert float(info["_wall_s"]) < 200  # the students sleep 300 s unless stopped


def test_disaggregated_bad_split_refused(slurm, stub_python, tmp_path):
    args = _args_file(tmp_path / "train.args", STUDENT_FLAGS, iters=1, teacher="/nonexistent")
    info, log_dir, text = _submit(slurm, "disaggregated.sbatch", tmp_path, "--nodes=2",
                                  "--ntasks-per-node=1", KD_PYTHON=stub_python,
                                  KD_ARGS_FILE=str(args), KD_TEACHER_NODES="2")
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), _explain(info, log_dir, text)
    assert "KD_TEACHER_NODES=2 must be in [1, 1]" in text


def test_disaggregated_needs_an_endpoint_or_a_teacher_step(slurm, stub_python, tmp_path):
    args = _args_file(tmp_path / "train.args", STUDENT_FLAGS, iters=1, teacher="/nonexistent")
    info, log_dir, text = _submit(slurm, "disaggregated.sbatch", tmp_path, "--nodes=1",
                                  "--ntasks-per-node=1", KD_PYTHON=stub_python,
                                  KD_ARGS_FILE=str(args))
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), _explain(info, log_dir, text)
    assert "set KD_TEACHER_ENDPOINT" in text


# --- the real program ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def colocated_job(slurm, teacher_ckpt, tmp_path_factory):
    """One uninterrupted ``colocated.sbatch`` job of :data:`PREEMPT_ITERS` iterations (an
    evaluation at the end): checked by :func:`test_colocated_job`, and the reference of the
    requeued run (the same flags but the evaluation interval, which changes no training loss).
    ``(info, log dir, output)``."""
    directory = tmp_path_factory.mktemp("colocated_job")
    args = _args_file(directory / "train.args", STUDENT_FLAGS, iters=PREEMPT_ITERS,
                      teacher=teacher_ckpt)
    info, log_dir, text = _submit(slurm, "colocated.sbatch", directory, "--nodes=1",
                                  f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=2",
                                  KD_ARGS_FILE=str(args))
    return info, log_dir, text


def test_colocated_job(colocated_job):
    info, log_dir, text = colocated_job
    _assert_completed(info, log_dir, text)
    job_id = info["JobId"]
    line = _launch_line(text, job_id)
    # the rendezvous: the first node's address (NodeAddr), a port derived from the job id
    assert "world 2" in line and f"127.0.0.1:{_job_port(job_id)}" in line, line
    _check_train_log(log_dir, info, text, iters=PREEMPT_ITERS)
    # Each rank's output is labelled; rank 0 prints its progress and the summary.
    assert "0: [" in text and f'0: {{"iterations": {PREEMPT_ITERS}' in text, text[-2000:]
    assert info["Restarts"] == "0" and "requeueing" not in text


def test_cache_build_job(slurm, teacher_ckpt, tmp_path):
    args = _args_file(tmp_path / "cache.args", CACHE_FLAGS, iters=2, teacher=teacher_ckpt)
    cache = tmp_path / "cache"
    info, log_dir, text = _submit(slurm, "cache_build.sbatch", tmp_path, "--nodes=1",
                                  f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=2",
                                  KD_ARGS_FILE=str(args), KD_CACHE_DIR=str(cache))
    _assert_completed(info, log_dir, text)
    summary = json.loads((log_dir / "cache_info.json").read_text())
    assert summary["complete"] is True
    assert summary["num_samples"] == summary["samples_built"] == 2 * 4
    assert summary["topk"] == 8 and summary["vocab_size"] == TEACHER_ARCH["vocab_size"]
    assert f"{cache}: OK" in text  # `megatron-kd cache verify` ran in the job


def test_disaggregated_job_with_a_teacher_step(slurm, teacher_ckpt, tmp_path):
    """One job, two job steps: a teacher replica and the student, each its own world."""
    args = _args_file(tmp_path / "train.args", STUDENT_FLAGS, iters=TRAIN_ITERS,
                      teacher=teacher_ckpt)
    info, log_dir, text = _submit(slurm, "disaggregated.sbatch", tmp_path, "--nodes=1",
                                  f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=3",
                                  KD_ARGS_FILE=str(args), KD_TEACHER_TASKS="1")
    _assert_completed(info, log_dir, text)
    _check_train_log(log_dir, info, text)
    events = [json.loads(line)["event"] for line in
              (log_dir / "teacher.jsonl").read_text().splitlines()]
    assert events[0] == "ready" and "connected" in events and events[-1] == "stopped"


def test_teacher_job_serves_a_separate_student_job(slurm, teacher_ckpt, tmp_path):
    """Two jobs: `teacher.sbatch` starts two one-rank replicas in its one allocation
    (``KD_TEACHER_REPLICAS=2``, a step each), both register at an endpoint, a student job of two
    data-parallel ranks reads it and each replica serves one of them; the teacher runs on after
    the student is done, until it is cancelled."""
    endpoint = tmp_path / "endpoint"
    serve_dir = tmp_path / "serve"
    serve_dir.mkdir()
    serve_args = _args_file(serve_dir / "serve.args", "--kd-teacher-load {teacher}",
                            teacher=teacher_ckpt)
    teacher_job, teacher_logs, teacher_out = _submit_nowait(
        slurm, "teacher.sbatch", serve_dir, "--nodes=1", f"--nodelist={slurm.nodes[1]}",
        "--ntasks-per-node=2", KD_ARGS_FILE=str(serve_args), KD_TEACHER_ENDPOINT=str(endpoint),
        KD_TEACHER_REPLICAS="2")
    try:
        # both replicas registered before the student starts: it then spreads over both
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(list(endpoint.glob("replica-*.json"))) < 2:
            assert time.monotonic() < deadline, (slurm.show_job(teacher_job),
                                                 teacher_out.read_text()
                                                 if teacher_out.exists() else "")
            assert slurm.show_job(teacher_job).get("JobState") in ("PENDING", "RUNNING"), \
                teacher_out.read_text() if teacher_out.exists() else "(no output)"
            time.sleep(0.5)
        student_dir = tmp_path / "student"
        student_dir.mkdir()
        args = _args_file(student_dir / "train.args", STUDENT_FLAGS, iters=TRAIN_ITERS,
                          teacher=teacher_ckpt)
        info, log_dir, text = _submit(slurm, "disaggregated.sbatch", student_dir, "--nodes=1",
                                      f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=2",
                                      KD_ARGS_FILE=str(args), KD_TEACHER_ENDPOINT=str(endpoint))
        _assert_completed(info, log_dir, text)
        _check_train_log(log_dir, info, text)
        assert slurm.show_job(teacher_job).get("JobState") == "RUNNING"  # it serves on
    finally:
        slurm.run("scancel", teacher_job, check=False)
    info = slurm.wait(teacher_job, timeout_s=JOB_TIMEOUT_S)
    requests = []
    for i in range(2):
        served = [json.loads(line) for line in (teacher_logs / f"teacher-{i}.jsonl").read_text()
                  .splitlines() if '"stats"' in line or '"stopped"' in line]
        requests.append(max((e["requests"] for e in served), default=0))
    # least loaded first: each of the 2 DP ranks on its own replica, a request a step each
    assert min(requests) >= TRAIN_ITERS, (requests, teacher_out.read_text()
                                          if teacher_out.exists() else "")


PREEMPT_ITERS = 60  # far more than run before the signal; the requeued job runs the rest


def _losses_by_step(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if not r.get("eval") and "event" not in r}


def _wait_for_steps(slurm: LocalSlurm, job_id: str, log: Path, steps: int, log_dir: Path,
                    out: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (log.exists() and len(_losses_by_step(log)) >= steps):
        assert time.monotonic() < deadline, f"no {steps} steps logged in {JOB_TIMEOUT_S} s"
        info = slurm.show_job(job_id)
        if info.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
            _assert_completed(info, log_dir, out.read_text(errors="replace"))
            pytest.fail(f"job {job_id} ended before {steps} steps were logged")
        time.sleep(0.2)


def test_scancel_term_saves_requeues_and_the_job_continues(slurm, teacher_ckpt, colocated_job,
                                                           tmp_path):
    """`scancel --signal=TERM` mid-run (what the time limit's --signal sends): every rank
    finishes its step and saves; the script sees the run's resumable exit record and requeues
    its job, which Slurm takes back (pending, one restart). The continuation -- here submitted
    as the next job of a chain, with the same flags -- resumes from the checkpoint and ends at
    --train-iters, not requeued; the losses of both parts are an uninterrupted job's.

    (Slurm's own restart of the requeued job is not waited for: on this single-host Slurm under
    a loaded CI machine the restarted batch script has failed at once, exit 1 with no output,
    in 2 of 4 runs, and passed alone; that restart is Slurm's, the script's part ends with the
    requeue.)"""
    ckpt = tmp_path / "ckpt"
    flags = STUDENT_FLAGS.replace("--train-iters {iters} --eval-interval {iters}",
                                  "--train-iters {iters} --eval-interval 100000")
    args = _args_file(tmp_path / "train.args", flags, iters=PREEMPT_ITERS, teacher=teacher_ckpt)
    extra = f"--save {ckpt} --load {ckpt} --save-interval 100000"
    run1 = tmp_path / "run1"
    run1.mkdir()
    job_id, log_dir, out = _submit_nowait(
        slurm, "colocated.sbatch", run1, "--nodes=1", f"--nodelist={slurm.nodes[0]}",
        "--ntasks-per-node=2", KD_ARGS_FILE=str(args), KD_EXTRA_ARGS=extra)
    log = log_dir / "train.jsonl"
    _wait_for_steps(slurm, job_id, log, 3, log_dir, out)
    slurm.run("scancel", "--signal=TERM", job_id)
    # requeued: Slurm holds a requeued job (BeginTime, 2 minutes here) before it may start again
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        info = slurm.show_job(job_id)
        if info.get("Restarts", "0") != "0" and info.get("JobState") == "PENDING":
            break
        assert info.get("JobState") in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED"), \
            _explain(info, log_dir, out.read_text(errors="replace"))
        assert time.monotonic() < deadline, "the job was not requeued"
        time.sleep(0.2)
    assert info["Restarts"] == "1", info
    slurm.run("scancel", job_id)  # the chain's next job continues instead
    text = out.read_text(errors="replace")
    assert "SIGTERM received: stopping after iteration" in text, text[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    exits = [r for r in records if r.get("event") == "exit"]
    assert len(exits) == 1 and exits[0]["reason"] == "signal" and exits[0]["resumable"]
    assert records[-1] == exits[0]  # the log's last record: what the script requeued on
    stopped = exits[0]["step"]
    assert 3 <= stopped < PREEMPT_ITERS
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == stopped
    assert f"requeueing job {job_id} (restart 1)" in text, text[-3000:]
    first = _losses_by_step(log)
    assert sorted(first) == list(range(1, stopped + 1))
    # the continuation: the same flags, to the end, not requeued
    run2 = tmp_path / "run2"
    run2.mkdir()
    info, log_dir2, text = _submit(slurm, "colocated.sbatch", run2, "--nodes=1",
                                   f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=2",
                                   KD_ARGS_FILE=str(args), KD_EXTRA_ARGS=extra)
    _assert_completed(info, log_dir2, text)
    assert f"resumed from iteration {stopped}" in text, text[-3000:]
    assert "requeueing" not in text
    second = _losses_by_step(log_dir2 / "train.jsonl")
    assert sorted(second) == list(range(stopped + 1, PREEMPT_ITERS + 1))
    # the reference: the same job, uninterrupted (the module's colocated job)
    info, log_dir3, text = colocated_job
    _assert_completed(info, log_dir3, text)
    straight = _losses_by_step(log_dir3 / "train.jsonl")
    both = first | second
    assert [both[i] for i in range(1, PREEMPT_ITERS + 1)] == \
        [straight[i] for i in range(1, PREEMPT_ITERS + 1)]


def _teacher_job(slurm: LocalSlurm, directory: Path, teacher_ckpt: str, endpoint: Path):
    """A one-replica ``teacher.sbatch`` job on the second node, registered at ``endpoint``
    (waited for); ``(job id, log dir, output path)``."""
    directory.mkdir()
    serve_args = _args_file(directory / "serve.args", "--kd-teacher-load {teacher}",
                            teacher=teacher_ckpt)
    before = set(endpoint.glob("replica-*.json")) if endpoint.exists() else set()
    job = _submit_nowait(slurm, "teacher.sbatch", directory, "--nodes=1",
                         f"--nodelist={slurm.nodes[1]}", "--ntasks-per-node=1",
                         KD_ARGS_FILE=str(serve_args), KD_TEACHER_ENDPOINT=str(endpoint))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not set(endpoint.glob("replica-*.json")) - before:
        info = slurm.show_job(job[0])
        assert info.get("JobState") in ("PENDING", "CONFIGURING", "RUNNING"), \
            _explain(info, job[1], job[2].read_text() if job[2].exists() else "")
        assert time.monotonic() < deadline, "the teacher replica never registered"
        time.sleep(0.3)
    return job


def test_teacher_job_ending_mid_run_is_replaced_and_no_step_changes(slurm, teacher_ckpt,
                                                                     tmp_path):
    """A long run outlives its teacher job: the teacher job is stopped mid-run (SIGTERM, what
    its time limit sends: the replica finishes its batch, withdraws and exits 0); the student
    waits (up to --kd-teacher-timeout) with its requests held; a second teacher job (as one
    chained with --dependency=afterany would) registers at the same endpoint, and the student
    re-sends and goes on. Every step is trained once, and the losses are those of a student run
    whose teacher never went away."""
    endpoint = tmp_path / "endpoint"
    first, _, first_out = _teacher_job(slurm, tmp_path / "teacher1", teacher_ckpt, endpoint)
    flags = STUDENT_FLAGS.replace("--train-iters {iters} --eval-interval {iters}",
                                  "--train-iters {iters} --eval-interval 100000")
    iters = PREEMPT_ITERS
    student = tmp_path / "student"
    student.mkdir()
    args = _args_file(student / "train.args", flags, iters=iters, teacher=teacher_ckpt)
    second = None
    try:
        job, log_dir, out = _submit_nowait(
            slurm, "disaggregated.sbatch", student, "--nodes=1", f"--nodelist={slurm.nodes[0]}",
            "--ntasks-per-node=2", KD_ARGS_FILE=str(args), KD_TEACHER_ENDPOINT=str(endpoint),
            KD_EXTRA_ARGS="--kd-teacher-timeout 300")
        log = log_dir / "train.jsonl"
        _wait_for_steps(slurm, job, log, 3, log_dir, out)
        slurm.run("scancel", "--signal=TERM", first)
        # gone, as a teacher job at its limit is (its exit status is the replica's business:
        # once a replica stopped with connections open aborted in its teardown, exit 134, and
        # what matters here is that the student rides it out)
        info = slurm.wait(first, timeout_s=JOB_TIMEOUT_S)
        assert info["JobState"] in ("COMPLETED", "FAILED"), info
        held = max(_losses_by_step(log))
        assert held < iters, "the student finished before its teacher went away"
        time.sleep(2)  # the student waits with no replica
        assert max(_losses_by_step(log)) == held
        second = _teacher_job(slurm, tmp_path / "teacher2", teacher_ckpt, endpoint)[0]
        info = slurm.wait(job, timeout_s=JOB_TIMEOUT_S)
        text = out.read_text(errors="replace")
        _assert_completed(info, log_dir, text)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        assert [e for e in records if e.get("event") == "failover"], text[-3000:]
        replaced = _losses_by_step(log)
        assert sorted(replaced) == list(range(1, iters + 1))
        # the reference: a student whose teacher (the second job's replica) stays
        reference = tmp_path / "reference"
        reference.mkdir()
        info, ref_logs, ref_text = _submit(
            slurm, "disaggregated.sbatch", reference, "--nodes=1",
            f"--nodelist={slurm.nodes[0]}", "--ntasks-per-node=2", KD_ARGS_FILE=str(args),
            KD_TEACHER_ENDPOINT=str(endpoint))
        _assert_completed(info, ref_logs, ref_text)
        straight = _losses_by_step(ref_logs / "train.jsonl")
        assert [replaced[i] for i in range(1, iters + 1)] == pytest.approx(
            [straight[i] for i in range(1, iters + 1)], rel=1e-6)
    finally:
        for teacher_job in (first, second):
            if teacher_job is not None:
                slurm.run("scancel", teacher_job, check=False)


def test_megatron_lm_job_runs_the_real_pretrain_gpt_on_two_nodes(slurm, tmp_path):
    """``megatron_lm.sbatch`` on two Slurm nodes, one task each: every node's torchrun runs
    ``examples/megatron_lm/train_kd_colocated.sh`` with ``STUDENT`` an ``import-hf`` directory
    (the same tiny Llama as the colocated teacher), one rank a node at TP 2 across the nodes,
    on the real patched ``pretrain_gpt.py`` (the first ``MEGATRON_LM_DIR`` checkout, through
    the test's CPU launcher): the job completes and the run saves its last iteration. Needs the
    real Megatron-LM tier's ``MEGATRON_LM_DIR`` and ``MEGATRON_LM_PYTHON``."""
    from test_megatron_lm_real import (
        LAUNCHER,
        MEGATRON_LM_ONLY,
        _checkouts,
        _megatron_lm_python,
        _patched_script,
    )

    if not _checkouts():
        pytest.skip("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)")
    pytest.importorskip("transformers")
    from support.hf_models import tiny_llama
    from support.text import TEXT, write_tokenizer

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    root, python = _checkouts()[0], _megatron_lm_python()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "part.txt").write_text(TEXT * 10, encoding="utf-8")
    tok = write_tokenizer(tmp_path / "tokenizer.json")
    preprocess([str(tmp_path / "text")], HFTokenizer(tok), str(tmp_path / "corpus"))
    hf_dir = tiny_llama(tmp_path, tied=False, vocab=500, name="llama")[0]
    student = tmp_path / "student"
    subprocess.run([sys.executable, "-m", "megatron_kd", "import-hf", "--hf-path", hf_dir,
                    "--save", str(student)], check=True, capture_output=True, timeout=600)
    bin_dir = tmp_path / "bin"  # the script's `torchrun`: Megatron-LM's interpreter's
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\nexec {python} -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    cpu_only = MEGATRON_LM_ONLY[MEGATRON_LM_ONLY.index("--tokenizer-type"):
                                MEGATRON_LM_ONLY.index("--log-interval")]
    run = tmp_path / "run"
    info, log_dir, text = _submit(
        slurm, "megatron_lm.sbatch", tmp_path, "--nodes=2", "--ntasks-per-node=1",
        MEGATRON_LM_DIR=root, STUDENT=str(student), GPUS_PER_NODE="1", TP="2",
        PRETRAIN_GPT=f"{LAUNCHER} {_patched_script(root, tmp_path)}",
        PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        PYTHONPATH=os.pathsep.join([root, str(REPO / "tests"), str(REPO)]),
        KD_MEGATRON_LM_ARGS=f"{run} {tmp_path / 'tb'} {student} {tmp_path / 'corpus'} unused",
        KD_EXTRA_ARGS=" ".join([*cpu_only, "--eval-iters", "0", "--eval-interval", "100",
                                "--save-interval", "2", "--log-interval", "1", "--split",
                                "90,5,5"]),
        SEQ_LENGTH="32", MICRO_BATCH="2", GLOBAL_BATCH="2", TRAIN_ITERS="2", LR="1e-3",
        WARMUP="0", PRECISION="fp32", KD_TEACHER_DTYPE="fp32", OMP_NUM_THREADS="1")
    _assert_completed(info, log_dir, text)
    assert "pretrain_gpt.py: 2 node(s) x 1 rank(s)" in text, text[-3000:]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2", \
        _explain(info, log_dir, text)
