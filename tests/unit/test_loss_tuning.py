"""The fused loss's CPU tuning (``CpuTuning``): resolved per machine, passed as configuration,
validated (one process, no process group)."""

import pytest
from support.kd_cases import compare, make_inputs, run_ours, spec

from megatron_kd.loss import CpuTuning, KDLossConfig, window


def _single(sp):
    inp = make_inputs(sp)
    ours = run_ours(sp, inp, [sp["padded_vocab"]], 0, None)
    compare(sp, inp, [ours], 1)
    return ours


def _proc_cpu_vendor() -> str | None:
    """``vendor_id`` as ``grep`` would find it; None without ``/proc/cpuinfo``."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            lines = [line for line in f if line.startswith("vendor_id")]
    except OSError:
        return None
    return lines[0].partition(":")[2].strip() if lines else ""


def test_cpu_tuning_is_the_machines_and_the_same_on_every_call():
    # slabs on AMD only (docs/benchmarks.md, the loss); one value per process (bit-identical
    # resumes)
    assert CpuTuning.for_cpu_vendor("AuthenticAMD").chunked_projection_rows == 384
    assert CpuTuning.for_cpu_vendor("GenuineIntel").chunked_projection_rows == 0
    assert CpuTuning.for_cpu_vendor("").chunked_projection_rows == 0
    vendor = _proc_cpu_vendor()
    if vendor is not None:
        assert CpuTuning.for_this_machine() == CpuTuning.for_cpu_vendor(vendor)
    assert CpuTuning.for_this_machine() == CpuTuning.for_this_machine()
    assert KDLossConfig().cpu_tuning is None  # resolved by the loss, per call


def test_the_default_tuning_is_this_machines(monkeypatch):
    # no cpu_tuning: the walk projects in slabs exactly when this machine's tuning says so
    slab_calls = []
    real = window.WindowWalker._chunked_projection

    def spy(self, x, w, out):
        slab_calls.append(x.shape[0])
        return real(self, x, w, out)

    monkeypatch.setattr(window.WindowWalker, "_chunked_projection", spy)
    _single(spec(window_size=6))
    assert bool(slab_calls) == (CpuTuning.for_this_machine().chunked_projection_rows >= 6)


@pytest.mark.parametrize("field,value", [("chunked_projection_rows", -1),
                                         ("projection_chunk", 0), ("block_elements", 0),
                                         ("block_elements", 2.5), ("blocks_with_tp", 1)])
def test_bad_cpu_tuning_raises(field, value):
    fields = dict(chunked_projection_rows=0) | {field: value}
    with pytest.raises(ValueError, match=f"{field} must be .*got {value!r}"):
        CpuTuning(**fields)


def test_cpu_tuning_must_be_a_cpu_tuning():
    with pytest.raises(ValueError, match="cpu_tuning must be a CpuTuning or None"):
        KDLossConfig(cpu_tuning={"block_elements": 1 << 21})
