#!/usr/bin/env python
"""Benchmark the disaggregated teacher (a ``megatron-kd teacher serve`` replica) against
colocated distillation, its wire and its failover (not a test). One piece: its three
measurements share the runs' launch, their logs and one table.

Every run is ``megatron-kd train`` itself (``megatron_kd.commands.train.train``) on mock data
in fresh processes, one CPU thread each, the student's world on gloo; each teacher replica is a
``megatron-kd teacher serve`` process of its own, registered at a directory endpoint.

1. Step time (fp32 wire, one replica):

   * ``colocated``: the teacher's forward, then the student's step, in one process, with
     ``--timing-log-level 1``: the step log's ``teacher-forward`` timer is the *teacher
     forward* time ``T``, the rest of the step (the student's full step with the KD loss,
     teacher projection included) the *student step* time ``S``.
   * ``disaggregated D=1, 2, 4``: the student connects to one replica with
     ``--kd-prefetch-depth D``. The student's wait for the teacher (the step log's
     ``kd_teacher_wait_s``) and the replica's forward time (its own log) tell waiting from
     contention.

   Every figure comes from what a run exposes (its JSON step log, a replica's log, the public
   ``Trainer.train_step`` and ``TeacherSource.start`` timed around): no private method is
   patched, so a refactor inside the trainer cannot break the tool silently.

   Target: with ``D >= 2`` the step time is at most 1.05 x max(T, S), the student never waits
   in steady state.

2. Wire (D=2, one replica): fp32, bf16 and fp8. Bytes per token each way as the run counts
   them (``kd_wire_bytes`` back, ``kd_wire_bytes_to_teacher`` out, per step over the step's
   tokens) against ``megatron-kd plan``'s figures (:func:`megatron_kd.planner.traffic.
   wire_bytes_per_token`, 4 bytes a token id). fp8 must halve bf16's hidden-state bytes (plus
   its 4-byte scale per token).

3. Failover (D=2, two replicas): the replica serving the student (the one that answered its
   last step, by the step log's ``kd_replica_tokens``) is SIGKILLed at step ``--kill-at-step``.
   Seconds lost: the excess of the worst step over the median step (the wait that found the
   replica dead, the reconnect, and the re-sent requests computed again),
   with the client's failover event (``seconds_lost``: the wait and the reconnect only). Target:
   at most one step plus the reconnect (the client's own first connect, timed).

4. Replicas: the student with ``--scaling-dp`` data-parallel ranks against 1, 2, 3 replicas of
   a teacher whose forward also sleeps ``--scaling-sleep-per-token`` seconds per token (a
   teacher on an accelerator of its own: on two shared cores, real compute in every replica
   would measure the cores, not the service). Student tokens/s (the kept steps' tokens over
   their summed time) against the planner's
   :func:`~megatron_kd.planner.traffic.served_tokens_per_s` with the measured inputs: the
   student's own rate (a colocated run's tokens over its steps less their teacher forward)
   and one replica's serving rate (its tokens over its forward seconds, from its log). The
   default sleep keeps even 3 replicas slower than the
   student, so each row measures how the service spreads the student's requests.

5. Wait (``--sections wait``, not in the default set): the student against a fast teacher
   (the real one, D=2) and a deliberately slow one (its forward also sleeps
   ``--slow-sleep-per-token`` s a token), written as ``megatron-kd report`` of the two runs to
   ``--report-dir``: the slow teacher shows the student's wait and an empty ring, the fast one
   no wait and a full ring.

Where the time went: per step, the student's main thread's on-CPU time and run-queue wait
(``/proc/thread-self/schedstat``). A machine check first times a single-threaded GEMM loop
alone and with a second copy running: on a small machine two busy processes slow each other
down, and that, not the wire, is then what separates the disaggregated step from max(T, S).

    python tools/bench_disagg.py                  # everything (about 10 minutes on 2 cores)
    python tools/bench_disagg.py --smoke --sections step   # tiny sizes: that it runs (CI)
    python tools/bench_disagg.py --sections step wire
    python tools/bench_disagg.py --sections wait --report-dir docs/teacher_wait
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from megatron_kd.testing.replicas import Replica

SECTIONS = ("step", "wire", "failover", "replicas")
#: --smoke: the sizes of a run that only shows every section works (seconds a run on 2 cores)
SMOKE = dict(teacher_layers=1, teacher_hidden=64, teacher_heads=2, student_layers=1,
             student_hidden=32, student_heads=2, vocab=256, seq_length=32, micro_batch_size=1,
             microbatches=2, steps=4, warmup=1, depths=[2], kill_at_step=2, scaling_dp=2,
             scaling_student_hidden=32, scaling_teacher_hidden=64,
             scaling_sleep_per_token=1e-4, slow_sleep_per_token=1e-3, probe_iters=5)
EXTRA_SECTIONS = ("wait",)


# ---------------------------------------------------------------------------------------------
# worker side (one process per student rank)
# ---------------------------------------------------------------------------------------------
def _schedstat() -> tuple[float, float]:
    """``(on-CPU s, runnable-but-waiting-for-a-CPU s)`` of this thread so far (Linux
    ``/proc/thread-self/schedstat``; zeros elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu_ns, run_queue_ns = f.read().split()[:2]
        return int(on_cpu_ns) / 1e9, int(run_queue_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _around(cls, name: str, before, after) -> None:
    """Call ``before()`` ahead of every ``cls.name`` call and ``after(state)`` once it returns
    (or raises). Only public methods are wrapped: a missing one stops the run naming it."""
    inner = getattr(cls, name, None)
    if inner is None or name.startswith("_"):
        raise RuntimeError(f"bench_disagg measures around the public {cls.__name__}.{name}, "
                           f"which is not there any more: update the tool")

    def method(self, *args, **kwargs):
        state = before()
        try:
            return inner(self, *args, **kwargs)
        finally:
            after(state)

    setattr(cls, name, method)


def _instrument() -> dict:
    """This student process's measurements beyond its step log: per step (around the public
    ``Trainer.train_step``) its main thread's on-CPU time and run-queue wait; the connect of a
    disaggregated teacher (around the public ``TeacherSource.start`` of the ``Remote``
    source). The teacher's forward, the wire wait and the step time come from the step log
    (``--timing-log-level 1`` adds the step's timers to it)."""
    from megatron_kd.modes.disaggregated import Remote
    from megatron_kd.training.trainer import Trainer

    stats: dict[str, list] = {"connect_s": [], "on_cpu_s": [], "run_queue_s": []}

    def cpu_after(start):
        cpu1, queue1 = _schedstat()
        stats["on_cpu_s"].append(cpu1 - start[0])
        stats["run_queue_s"].append(queue1 - start[1])

    _around(Trainer, "train_step", _schedstat, cpu_after)
    _around(Remote, "start", time.perf_counter,
            lambda t0: stats["connect_s"].append(time.perf_counter() - t0))
    return stats


def _make_teacher(make: dict) -> None:
    """A random teacher's checkpoint (``make``: its arch, seed and directory), in the world of
    this process."""
    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    arch = GPTArchConfig(**make["arch"])
    with model_parallel(tp=1):
        save_model_checkpoint(build_gpt_model(arch, seed=make["seed"]), arch, make["directory"])


def _worker(rank: int, kind: str, world: int, tmp: str, payload: dict) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # Megatron-Core's deprecation and Apex notices, per process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    try:
        if kind == "make_teacher":
            _make_teacher(payload)
            result: dict = {}
        else:
            from megatron_kd.commands.train import parse_args, train

            result = {}
            if payload.get("make_teacher"):  # the run's teacher first, in its process
                t0 = time.perf_counter()
                _make_teacher(payload["make_teacher"])
                result["make_teacher_s"] = time.perf_counter() - t0
            stats = _instrument()
            train(parse_args(payload["argv"]))
            result["stats"] = stats
        with open(os.path.join(tmp, f"result.{rank}"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _gemm_probe(rank: int, tmp: str, iters: int) -> None:
    """A fixed single-threaded GEMM loop (model-like shapes); writes its wall time."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(512, 512)
    w = torch.randn(512, 2048)
    (x @ w).sum()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        (x @ w).relu_() @ w.t()
    with open(os.path.join(tmp, f"probe.{rank}"), "w") as f:
        f.write(str(time.perf_counter() - t0))


def contention_probe(iters: int) -> dict:
    """The same GEMM loop in 1 process (this one: no process to start), then in 2 at once."""
    import torch
    import torch.multiprocessing as mp

    out = {}
    for n in (1, 2):
        with tempfile.TemporaryDirectory(prefix="bench_disagg_probe_") as tmp:
            if n == 1:
                threads = torch.get_num_threads()
                try:
                    _gemm_probe(0, tmp, iters)
                finally:
                    torch.set_num_threads(threads)
            else:
                mp.spawn(_gemm_probe, args=(tmp, iters), nprocs=n, join=True)
            times = []
            for r in range(n):
                with open(os.path.join(tmp, f"probe.{r}")) as f:
                    times.append(float(f.read()))
        out[f"gemm_loop_{n}_process_s"] = max(times)
    out["slowdown_2_processes"] = out["gemm_loop_2_process_s"] / out["gemm_loop_1_process_s"]
    return out


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def _spawn(kind: str, world: int, payload: dict) -> list[dict]:
    """Run ``kind`` on ``world`` fresh processes; returns their results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_disagg_") as tmp:
        mp.spawn(_worker, args=(kind, world, tmp, payload), nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"result.{r}")) as f:
                results.append(json.load(f))
    return results


def _arch(layers, hidden, heads, ffn, vocab, seq) -> dict:
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_query_groups": None, "ffn_hidden_size": ffn or 4 * hidden,
            "vocab_size": vocab, "padded_vocab_size": vocab, "max_position_embeddings": seq,
            "tie_embeddings": True}


def student_argv(a, teacher_dir: str, log: str, *, layers: int, hidden: int, heads: int,
                 dp: int = 1, microbatches: int | None = None, steps: int | None = None):
    m = a.microbatches if microbatches is None else microbatches
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--ffn-hidden-size", str(4 * hidden),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * m * dp),
            "--train-iters", str(steps or a.steps), "--lr", "1e-4", "--lr-warmup-iters", "1",
            "--mock-data", "--no-progress", "--eval-iters", "0", "--eval-interval", "1000000",
            "--seed", str(a.seed), "--kd-teacher-load", teacher_dir, "--kd-ce-weight", "0.1",
            "--kd-teacher-timeout", str(a.teacher_timeout), "--timing-log-level", "1",
            "--log-json", log]


def _median_after(values: list, warmup: int):
    kept = values[warmup:]
    return statistics.median(kept) if kept else None


def _read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Bench:
    def __init__(self, a, workdir: str) -> None:
        self.a, self.workdir, self.n = a, workdir, 0
        #: teachers not made yet: directory -> make_teacher's payload. The first run that
        #: needs one makes it: a colocated run of one rank in its own process before it
        #: trains (one process start less), anything else in a process of its own first.
        self.pending: dict[str, dict] = {}

    def teacher(self, directory: str, arch: dict) -> str:
        """``directory``, where the teacher of ``arch`` will be (made when first needed)."""
        self.pending[directory] = {"arch": arch, "seed": self.a.seed, "directory": directory}
        return directory

    def ensure_teacher(self, directory: str) -> None:
        if directory in self.pending:
            _spawn("make_teacher", 1, self.pending.pop(directory))

    def _dir(self, name: str) -> str:
        self.n += 1
        d = os.path.join(self.workdir, f"{self.n:02d}_{name}")
        os.makedirs(d)
        return d

    def student(self, name: str, kind: str, teacher_dir: str, *, extra=(), dp: int = 1,
                size: str = "main", steps: int | None = None, during=None) -> dict:
        """One student run; ``during(log_path)`` runs on a thread meanwhile (the failover)."""
        import threading

        a = self.a
        d = self._dir(name)
        log = os.path.join(d, "student.jsonl")
        shape = ({"layers": a.student_layers, "hidden": a.student_hidden,
                  "heads": a.student_heads} if size == "main" else
                 {"layers": 1, "hidden": a.scaling_student_hidden, "heads": 2})
        m = a.microbatches if size == "main" else 1
        argv = student_argv(a, teacher_dir, log, dp=dp, microbatches=m, steps=steps, **shape)
        argv += list(extra)
        side = threading.Thread(target=during, args=(log,), daemon=True) if during else None
        payload: dict = {"argv": argv}
        if kind == "colocated" and dp == 1 and teacher_dir in self.pending:
            payload["make_teacher"] = self.pending.pop(teacher_dir)
        else:
            self.ensure_teacher(teacher_dir)
        if side:
            side.start()
        t0 = time.perf_counter()
        results = _spawn(kind, dp, payload)
        wall = time.perf_counter() - t0 - results[0].get("make_teacher_s", 0.0)
        if side:
            side.join(timeout=60)
        records = _read_log(log)
        steps_ = [r for r in records if "step_time_s" in r]
        times = [r["step_time_s"] for r in steps_]
        st = results[0]["stats"]
        point = {"name": name, "kind": kind, "wall_s": wall, "step_times_s": times,
                 "log": log,
                 "step_time_s": _median_after(times, a.warmup), "records": steps_,
                 "events": [r for r in records if r.get("event")],
                 "on_cpu_s": _median_after(st["on_cpu_s"], a.warmup),
                 "run_queue_s": _median_after(st["run_queue_s"], a.warmup),
                 "tokens_per_step": a.micro_batch_size * m * dp * a.seq_length}
        if kind == "colocated":
            # T: the teacher's forward as the step log's timers time it; S: the rest of the
            # step (the student's full step with the KD loss, teacher projection included)
            fwd = [(r.get("timers") or {}).get("teacher-forward") for r in steps_]
            if any(f is None for f in fwd):
                raise RuntimeError(f"{log}: a colocated step without the teacher-forward "
                                   f"timer (--timing-log-level 1)")
            student = [t - f for t, f in zip(times, fwd)]
            point["teacher_forward_s"] = _median_after(fwd, a.warmup)
            point["student_step_s"] = _median_after(student, a.warmup)
            kept_student = student[a.warmup:]
            point["student_tokens_per_s"] = (point["tokens_per_step"] * len(kept_student)
                                             / sum(kept_student)) if kept_student else None
        else:
            point["wire_wait_s"] = _median_after(
                [r.get("kd_teacher_wait_s") for r in steps_], a.warmup)
            point["connect_s"] = st["connect_s"][0] if st["connect_s"] else None
        kept = times[a.warmup:]  # throughput: all the kept steps' tokens over their time
        point["tokens_per_s"] = point["tokens_per_step"] * len(kept) / sum(kept) if kept else None
        return point

    def disaggregated(self, name: str, teacher_dir: str, *, depth: int, wire: str,
                      replicas: int = 1, sleep_per_token: float = 0.0, dp: int = 1,
                      size: str = "main", kill_at_step: int | None = None,
                      steps: int | None = None) -> dict:
        d = self._dir(name + "_replicas")
        endpoint = os.path.join(d, "endpoint")
        self.ensure_teacher(teacher_dir)
        timeout = self.a.teacher_timeout
        started = [Replica(endpoint, teacher_dir, log=os.path.join(d, f"replica{i}.jsonl"),
                           sleep_per_token=sleep_per_token, start_timeout_s=timeout,
                           extra=("--kd-teacher-timeout", str(timeout)))
                   for i in range(replicas)]
        killed: dict = {}

        def kill_serving(log: str) -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                done = [r for r in _read_log(log) if "step_time_s" in r]
                if len(done) >= kill_at_step:
                    # the replica that answered the last step (its step log says), not the
                    # one that served most so far: a rebalance may have moved the student
                    last = done[-1].get("kd_replica_tokens") or {}
                    serving = max(last, key=last.get) if last else None
                    victim = next((r for r in started if r.replica == serving),
                                  max(started, key=Replica.requests_served))
                    victim.kill()
                    killed.update(replica=victim.replica, at_step=len(done), time=time.time())
                    return
                time.sleep(0.05)

        try:
            point = self.student(
                name, "disaggregated", teacher_dir, dp=dp, size=size, steps=steps,
                extra=["--kd-mode", "disaggregated", "--kd-teacher-endpoint", endpoint,
                       "--kd-prefetch-depth", str(depth), "--kd-wire-dtype", wire],
                during=kill_serving if kill_at_step else None)
        finally:
            for replica in started:
                replica.stop()
        served = [f for f in (r.final_stats() for r in started) if f]
        point.update(depth=depth, wire=wire, replicas=replicas, killed=killed or None,
                     replica_stats=served)
        tokens = sum(f.get("tokens", 0) for f in served)
        forward_s = sum(f.get("forward_s", 0.0) for f in served)
        point["replica_tokens_per_forward_s"] = tokens / forward_s if forward_s else None
        point["teacher_forward_per_step_s"] = forward_s / len(point["step_times_s"]) \
            if point["step_times_s"] else None
        recs = point["records"]
        if recs:
            back = {r["kd_wire_bytes"] for r in recs}
            out = {r["kd_wire_bytes_to_teacher"] for r in recs}
            per = point["tokens_per_step"]
            point["bytes_back_per_token"] = (back.pop() / per) if len(back) == 1 else sorted(back)
            point["bytes_out_per_token"] = (out.pop() / per) if len(out) == 1 else sorted(out)
        return point


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, list):
        return "varies " + ",".join(f"{v:g}" for v in x)
    return f"{x:.{digits}f}"


# --- the sections ------------------------------------------------------------------------------
def run_step(bench: Bench, teacher: str) -> dict:
    a = bench.a
    coloc = bench.student("colocated", "colocated", teacher)
    t, s = coloc["teacher_forward_s"], coloc["student_step_s"]
    bound = max(t, s)
    rows = [coloc]
    for depth in a.depths:
        rows.append(bench.disaggregated(f"disaggregated_d{depth}", teacher, depth=depth,
                                        wire="fp32"))
    for p in rows:
        p["x_max_teacher_student"] = p["step_time_s"] / bound
    target = [p for p in rows if p.get("depth", 0) >= 2]
    summary = {"teacher_forward_s": t, "student_step_s": s, "max_teacher_student_s": bound,
               "target_ratio": 1.05,
               "target_met": bool(target) and all(p["x_max_teacher_student"] <= 1.05
                                                  for p in target)}
    lines = ["| run | step time s (median) | x max(T, S) | student wire wait s/step | "
             "student on-CPU s/step | student run-queue s/step | teacher forward s/step |",
             "|---|---|---|---|---|---|---|",
             f"| teacher forward alone (T) | {_fmt(t)} | {_fmt(t / bound, 2)} | | | | |",
             f"| student step (S: colocated step - its teacher forward) | {_fmt(s)} | "
             f"{_fmt(s / bound, 2)} | | | | |"]
    for p in rows:
        label = ("colocated (teacher then student, 1 process)" if p["kind"] == "colocated"
                 else f"disaggregated, 1 replica, prefetch depth {p['depth']}")
        fwd = p["teacher_forward_s"] if p["kind"] == "colocated" else \
            p["teacher_forward_per_step_s"]
        lines.append(f"| {label} | {_fmt(p['step_time_s'])} | "
                     f"{_fmt(p['x_max_teacher_student'], 2)} | {_fmt(p.get('wire_wait_s'))} | "
                     f"{_fmt(p['on_cpu_s'])} | {_fmt(p['run_queue_s'])} | {_fmt(fwd)} |")
    return {"points": rows, "summary": summary, "table": "\n".join(lines)}


def run_wire(bench: Bench, teacher: str) -> dict:
    from megatron_kd.planner import traffic

    a = bench.a
    rows, lines = [], ["| wire | bytes/token back (run) | planner | bytes/token out (run) | "
                       "planner | step time s |", "|---|---|---|---|---|---|"]
    for wire in ("fp32", "bf16", "fp8"):
        p = bench.disaggregated(f"wire_{wire}", teacher, depth=2, wire=wire)
        p["planner_back_per_token"] = traffic.wire_bytes_per_token(a.teacher_hidden, wire)
        p["planner_out_per_token"] = traffic.TOKEN_ID_BYTES
        rows.append(p)
        lines.append(f"| {wire} | {_fmt(p['bytes_back_per_token'], 0)} | "
                     f"{p['planner_back_per_token']} | {_fmt(p['bytes_out_per_token'], 0)} | "
                     f"{p['planner_out_per_token']} | {_fmt(p['step_time_s'])} |")
    by = {p["wire"]: p for p in rows}
    summary = {
        "exact": all(p["bytes_back_per_token"] == p["planner_back_per_token"]
                     and p["bytes_out_per_token"] == p["planner_out_per_token"] for p in rows),
        "fp8_over_bf16_bytes": (by["fp8"]["bytes_back_per_token"]
                                / by["bf16"]["bytes_back_per_token"]),
    }
    return {"points": rows, "summary": summary, "table": "\n".join(lines)}


def run_failover(bench: Bench, teacher: str) -> dict:
    p = bench.disaggregated("failover", teacher, depth=2, wire="fp32", replicas=2,
                            kill_at_step=bench.a.kill_at_step)
    return failover_result(bench.a, p)


def failover_result(a, p: dict) -> dict:
    """The failover row: the time the death cost (the worst step over the median: the wait
    that found the replica dead, the reconnect, and the re-sent requests computed again by the
    other replica), against one step plus the reconnect."""
    events = [e for e in p["events"] if e.get("event") == "failover"]
    times = p["step_times_s"]
    median = p["step_time_s"]
    excess = max(times) - median if times else None
    seconds_lost = max((e["seconds_lost"] for e in events), default=None)
    allowed = (median or 0) + (p.get("connect_s") or 0)
    summary = {"failovers": len(events), "event_seconds_lost": seconds_lost,
               "step_excess_s": excess, "median_step_s": median, "connect_s": p.get("connect_s"),
               "target_s": allowed, "steps_finished": len(times), "steps_asked": a.steps,
               "target_met": bool(events) and len(times) == a.steps
               and excess is not None and excess <= allowed}
    table = ("| failover | replica killed at step | failovers | seconds lost: worst step - "
             "median | of which waiting and reconnecting (event) | target: median step + "
             "connect s | steps finished |\n|---|---|---|---|---|---|---|\n"
             f"| 2 replicas, SIGKILL the serving one | "
             f"{(p['killed'] or {}).get('at_step', '-')} | {len(events)} | {_fmt(excess)} | "
             f"{_fmt(seconds_lost)} | {_fmt(allowed)} | {len(times)} of {a.steps} |")
    return {"points": [p], "summary": summary, "table": table}


def run_replicas(bench: Bench, teacher: str) -> dict:
    from megatron_kd.planner import traffic

    a = bench.a
    dp = a.scaling_dp
    # the student's own rate: a colocated run's tokens over its steps less their teacher forward
    alone = bench.student("scaling_colocated", "colocated", teacher, dp=dp, size="scaling")
    rows = []
    for n in (1, 2, 3):
        rows.append(bench.disaggregated(
            f"scaling_{n}_replicas", teacher, depth=2, wire="fp32", replicas=n, dp=dp,
            size="scaling", sleep_per_token=a.scaling_sleep_per_token))
    per_replica = rows[0]["replica_tokens_per_forward_s"]
    lines = ["| replicas | student tokens/s (run) | planner | run / planner |",
             "|---|---|---|---|",
             f"| student alone (colocated less its teacher forward) | "
             f"{_fmt(alone['student_tokens_per_s'], 0)} | | |"]
    for p in rows:
        p["planner_tokens_per_s"] = traffic.served_tokens_per_s(
            alone["student_tokens_per_s"], p["replicas"], per_replica)
        p["run_over_planner"] = p["tokens_per_s"] / p["planner_tokens_per_s"]
        lines.append(f"| {p['replicas']} | {_fmt(p['tokens_per_s'], 0)} | "
                     f"{_fmt(p['planner_tokens_per_s'], 0)} | {_fmt(p['run_over_planner'], 2)} |")
    summary = {"student_alone_tokens_per_s": alone["student_tokens_per_s"],
               "replica_tokens_per_s": per_replica,
               "run_over_planner": [p["run_over_planner"] for p in rows]}
    return {"points": [alone, *rows], "summary": summary, "table": "\n".join(lines)}


def run_wait(bench: Bench, teacher: str) -> dict:
    """A fast and a slow teacher, the student's wait and ring in ``megatron-kd report``."""
    import shutil

    from megatron_kd.commands.report import RunLog, write_report

    a = bench.a
    fast = bench.disaggregated("wait_fast", teacher, depth=2, wire="fp32")
    slow = bench.disaggregated("wait_slow", teacher, depth=2, wire="fp32",
                               sleep_per_token=a.slow_sleep_per_token)
    lines = ["| teacher | step time (median) | student wait per step (median) | ring occupancy "
             "(median) |", "|---|---|---|---|"]
    for label, p in (("fast (real forward)", fast),
                     (f"slow (+{a.slow_sleep_per_token * 1e3:g} ms a token)", slow)):
        kept = p["records"][a.warmup:-1]  # the last step drains the ring: nothing left to send
        p["wait_per_step_s"] = statistics.median(r["kd_teacher_wait_s"] for r in kept)
        p["ring_occupancy"] = statistics.median(r["kd_ring_occupancy"] for r in kept)
        lines.append(f"| {label} | {_fmt(p['step_time_s'])} s | {_fmt(p['wait_per_step_s'])} s "
                     f"| {_fmt(p['ring_occupancy'], 2)} |")
    written = {}
    if a.report_dir:
        os.makedirs(a.report_dir, exist_ok=True)
        written = write_report([RunLog(fast["log"], "fast teacher"),
                                RunLog(slow["log"], "slow teacher")], a.report_dir,
                               "student against a fast and a slow teacher (D=2)")
        for p in (fast, slow):  # keep the logs beside the report (the bench's tmp goes away)
            shutil.copy(p["log"], os.path.join(a.report_dir, p["name"] + ".jsonl"))
    summary = {name: {"wait_per_step_s": p["wait_per_step_s"],
                      "ring_occupancy": p["ring_occupancy"], "step_time_s": p["step_time_s"]}
               for name, p in (("fast", fast), ("slow", slow))}
    return {"points": [fast, slow], "summary": summary, "report": written,
            "table": "\n".join(lines)}


def plot(a, results: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    panels = [k for k in ("step", "failover", "replicas") if k in results]
    if not panels:  # the wait section has its own plots (megatron-kd report)
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        r = results[key]
        if key == "step":
            sm = r["summary"]
            pts = r["points"]
            labels = ["T alone", "S alone"] + [
                "colocated" if p["kind"] == "colocated" else f"D={p['depth']}" for p in pts]
            values = [sm["teacher_forward_s"], sm["student_step_s"]] + [
                p["step_time_s"] for p in pts]
            ax.bar(range(len(values)), values,
                   color=["tab:gray"] * 2 + ["tab:red" if p["kind"] == "colocated"
                                             else "tab:blue" for p in pts])
            ax.set_xticks(range(len(values)), labels, fontsize=8)
            ax.axhline(1.05 * sm["max_teacher_student_s"], color="k", ls=":", lw=1,
                       label="1.05 x max(T, S)")
            ax.set(ylabel="s per step (median)", title="step time")
            ax.legend(fontsize=8)
        elif key == "failover":
            p = r["points"][0]
            ax.plot(range(1, len(p["step_times_s"]) + 1), p["step_times_s"], marker="o", ms=3)
            if p["killed"]:
                ax.axvline(p["killed"]["at_step"] + 0.5, color="tab:red", ls="--",
                           label="replica SIGKILLed")
            ax.set(xlabel="step", ylabel="step_time_s", title="failover (2 replicas)")
            ax.legend(fontsize=8)
        else:
            pts = r["points"][1:]
            xs = [p["replicas"] for p in pts]
            ax.plot(xs, [p["tokens_per_s"] for p in pts], marker="o", label="run")
            ax.plot(xs, [p["planner_tokens_per_s"] for p in pts], marker="x", ls="--",
                    label="planner")
            ax.set(xlabel="teacher replicas", ylabel="student tokens/s",
                   title=f"replicas ({a.scaling_dp} student DP ranks)")
            ax.set_xticks(xs)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", choices=SECTIONS + EXTRA_SECTIONS,
                   default=list(SECTIONS))
    p.add_argument("--slow-sleep-per-token", type=float, default=2e-3,
                   help="wait section: the slow teacher's extra seconds a token")
    p.add_argument("--report-dir", default="bench_out/teacher_wait",
                   help="wait section: where megatron-kd report of the two runs goes")
    p.add_argument("--teacher-layers", type=int, default=4)
    p.add_argument("--teacher-hidden", type=int, default=512)
    p.add_argument("--teacher-heads", type=int, default=8)
    p.add_argument("--student-layers", type=int, default=2)
    p.add_argument("--student-hidden", type=int, default=256)
    p.add_argument("--student-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192,
                   help="shared vocabulary (a multiple of 128: no padding)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--kill-at-step", type=int, default=5)
    p.add_argument("--scaling-dp", type=int, default=3)
    p.add_argument("--scaling-student-hidden", type=int, default=64)
    p.add_argument("--scaling-teacher-hidden", type=int, default=128)
    p.add_argument("--scaling-sleep-per-token", type=float, default=1e-3)
    p.add_argument("--teacher-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--probe-iters", type=int, default=200,
                   help="GEMM iterations of the machine check (two processes vs one; 0: skip)")
    p.add_argument("--out", default="bench_out/bench_disagg.json")
    p.add_argument("--plot", default="bench_out/bench_disagg.png")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models and few steps (the size flags are then ignored): that "
                        "every section runs end to end, not figures")
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    if a.vocab % 128:
        p.error(f"--vocab {a.vocab} must be a multiple of 128 (the student pads to 128)")
    if a.steps <= a.warmup or a.kill_at_step >= a.steps:
        p.error("need --warmup < --kill-at-step < --steps")

    t_start = time.perf_counter()
    probe = contention_probe(a.probe_iters) if a.probe_iters else None
    if probe:
        print(f"machine check: a single-threaded GEMM loop takes "
              f"{probe['gemm_loop_1_process_s']:.2f} s alone, "
              f"{probe['gemm_loop_2_process_s']:.2f} s with a second copy running "
              f"({probe['slowdown_2_processes']:.2f}x)", flush=True)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_disagg_") as tmp:
        bench = Bench(a, tmp)
        teacher = bench.teacher(os.path.join(tmp, "teacher"), _arch(
            a.teacher_layers, a.teacher_hidden, a.teacher_heads, None, a.vocab, a.seq_length))
        small = bench.teacher(os.path.join(tmp, "scaling_teacher"), _arch(
            1, a.scaling_teacher_hidden, 2, None, a.vocab, a.seq_length))
        runners = {"step": run_step, "wire": run_wire, "failover": run_failover,
                   "replicas": run_replicas, "wait": run_wait}
        for section in a.sections:
            results[section] = runners[section](bench, small if section == "replicas"
                                                else teacher)
            print(f"\n== {section}\n{results[section]['table']}", flush=True)
    print(f"\nteacher {a.teacher_layers} layers h {a.teacher_hidden}, student "
          f"{a.student_layers} layers h {a.student_hidden}, vocab {a.vocab}, seq {a.seq_length}, "
          f"micro batch {a.micro_batch_size} x {a.microbatches} microbatches per step, fp32 "
          f"weights, 1 thread per process, median over steps {a.warmup + 1}-{a.steps}")
    if "step" in results:
        sm = results["step"]["summary"]
        print(f"step target (D >= 2 within 1.05 x max(T, S) = "
              f"{1.05 * sm['max_teacher_student_s']:.3f} s): "
              f"{'met' if sm['target_met'] else 'NOT met'}")
    if "wire" in results:
        sm = results["wire"]["summary"]
        print(f"wire bytes each way equal the planner's: {'yes' if sm['exact'] else 'NO'}; "
              f"fp8 / bf16 hidden-state bytes: {sm['fp8_over_bf16_bytes']:.3f}")
    if "failover" in results:
        sm = results["failover"]["summary"]
        print(f"failover target (worst step - median <= median step + connect = "
              f"{_fmt(sm['target_s'])} s): {'met' if sm['target_met'] else 'NOT met'}")
    for r in results.values():
        for pt in r["points"]:
            pt.pop("records", None)
            pt.pop("log", None)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "machine_check": probe, "cpu_count": os.cpu_count(),
                   "results": results, "wall_s": time.perf_counter() - t_start}, f, indent=1)
    print(f"wrote {a.out}")
    if a.plot:
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        if plot(a, results, a.plot):
            print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
