"""The C allocator's settings for a worker process, applied once at its start, before its
threads allocate (`dmem worker`, `dmem dev`; the memory benchmark's floor worker applies the
same, so that its floor has them too: bench/floor_worker.py).

Why: a worker runs its activities on 16 threads, and glibc gives each thread that allocates an
arena of its own (up to 8 per core); memory freed in an arena stays resident for that arena's
later use, so each thread's peak stays. Two arenas, shared by every thread, keep 8-10 MiB
less resident after the memory benchmark's workload, at a CPU cost within its noise.
Not kept, as measured there (docs/benchmarks.md, memory): a fixed mmap threshold (another
3-8 MiB, but ~20% more worker CPU: every large buffer mapped and faulted in anew), and
malloc_trim after the rotation sweep (~9 MiB, but only in the moment after it).

Nothing is changed where the C library is not glibc. This module imports nothing of ours:
the floor worker imports it.
"""

import ctypes

M_ARENA_MAX = -8
"""mallopt's parameter number (glibc's malloc.h)."""
ARENAS = 2


def bound_malloc() -> bool:
    """At most ARENAS malloc arenas in this process; False where the C library is not
    glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_ARENA_MAX, ARENAS) == 1)
