"""The C library's allocator: give the heap's freed memory back to the operating system.

glibc keeps memory a process freed inside its heaps (only the top of a heap is returned by itself), so the holes
left by one role call's tensors (a layer's gathered weights, gradients, activations: many are below the size glibc
maps on their own) stay in the process's resident memory. In the 0.5B run (``recipes/real_size_cpu.yaml``, 2
processes) each update left 1.5 GB so held, and the held part grew from step to step until a rank was killed by the
out-of-memory killer; with :func:`release_free_heap` after every role call a rank's resident memory between steps
stayed at 6.3 GB instead of 8.7-9.3 GB, at no measurable cost in time (docs/sizing.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_free_heap"]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None on another C library (musl, macOS), where the call is not needed or not there."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def release_free_heap() -> bool:
    """Return the free memory of every heap of this process to the operating system (``malloc_trim(0)``); whether
    any was returned (False where the C library is not glibc). Runs on: any process (a worker after each role
    call)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
