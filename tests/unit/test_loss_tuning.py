"""The fused loss's CPU tuning (``CpuTuning``): resolved per machine, passed as configuration,
validated (one process, no process group)."""

import io

import pytest
from support.kd_cases import single_case, spec

from megatron_kd.loss import CpuTuning, KDLossConfig, config, window

CPUINFO = {"AuthenticAMD": "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n",
           "GenuineIntel": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 143\n",
           "": "processor\t: 0\nCPU implementer\t: 0x41\n"}  # an Arm machine: no vendor_id


@pytest.fixture
def fake_cpuinfo(monkeypatch):
    """``set(text)``: the loss's config reads ``text`` as ``/proc/cpuinfo`` (its per-process
    cache cleared before and after)."""

    def set_text(text):
        def fake_open(path, *args, **kwargs):
            assert path == "/proc/cpuinfo", path
            return io.StringIO(text)
        monkeypatch.setattr(config, "open", fake_open, raising=False)
        config._cpu_vendor.cache_clear()

    yield set_text
    monkeypatch.undo()
    config._cpu_vendor.cache_clear()


@pytest.mark.parametrize("vendor,rows", [("AuthenticAMD", 384), ("GenuineIntel", 0), ("", 0)])
def test_cpu_tuning_follows_the_machines_vendor(fake_cpuinfo, vendor, rows):
    # slabs on AMD only (docs/benchmarks.md, the loss), read from the machine's cpuinfo
    fake_cpuinfo(CPUINFO[vendor])
    assert config._cpu_vendor() == vendor
    assert CpuTuning.for_this_machine().chunked_projection_rows == rows
    assert CpuTuning.for_this_machine() == CpuTuning(chunked_projection_rows=rows)
    assert KDLossConfig().cpu_tuning is None  # resolved by the loss, per call


def test_cpu_vendor_is_read_once_per_process(fake_cpuinfo, monkeypatch):
    fake_cpuinfo(CPUINFO["AuthenticAMD"])
    assert config._cpu_vendor() == "AuthenticAMD"
    # one value per process (bit-identical resumes): a later read of another file is not seen
    monkeypatch.setattr(config, "open", lambda *a, **k: io.StringIO(CPUINFO["GenuineIntel"]),
                        raising=False)
    assert config._cpu_vendor() == "AuthenticAMD"


def test_the_default_tuning_is_this_machines(monkeypatch):
    # no cpu_tuning: the walk projects in slabs exactly when this machine's tuning says so
    slab_calls = []
    real = window.WindowWalker._chunked_projection

    def spy(self, x, w, out):
        slab_calls.append(x.shape[0])
        return real(self, x, w, out)

    monkeypatch.setattr(window.WindowWalker, "_chunked_projection", spy)
    single_case(spec(window_size=6))
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
