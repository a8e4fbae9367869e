"""How many pytest-xdist workers ``-n auto`` starts (``tests/conftest.py``'s hook)."""

import os

#: Memory one worker may need at its peak: a module's pool of up to four gloo ranks and a teacher
#: replica or a torchrun beside it, about 0.5-1 GiB a process.
WORKER_MEMORY_BYTES = 6 << 30


def worker_count(cores: int | None, memory_bytes: int | None) -> int:
    """A worker per usable core, fewer where ``memory_bytes`` would not hold them (unknown
    figures do not limit); at least one."""
    cores = cores or 1
    by_memory = memory_bytes // WORKER_MEMORY_BYTES if memory_bytes else cores
    return max(1, min(cores, by_memory))


def machine_worker_count() -> int:
    """:func:`worker_count` of this machine: the cores this process may run on, the memory."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return worker_count(cores, memory)
