"""C functions that compiled (numba) kernels call by symbol name: memcpy, and the XXH3-64
streaming API of the xxhash wheel's own C library.

Shared because the SDK's block copy (kvstore_client/_blockcopy_kernel.py) and the daemon's Get
copy (kvstore/_getcopy_kernel.py) both hash with exactly these entry points, so their checksums
equal the commit checksum bit for bit. Importing this module registers the symbols; numba can
then cache the machine code that calls them (the address is registered again, under the same
name, in every process).
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import xxhash._xxhash as _xx
from numba import types as nt

_libxx = ctypes.CDLL(_xx.__file__)
_libc = ctypes.CDLL(None)


def _extern(name: str, lib: ctypes.CDLL, sig: nt.Signature) -> nt.ExternalFunction:
    llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
    return nt.ExternalFunction(name, sig)


# Pointers travel as integers (x86-64 and aarch64 pass both in the same registers).
_u64 = nt.uint64
memcpy = _extern("memcpy", _libc, _u64(_u64, _u64, _u64))
xxh3_create = _extern("XXH3_createState", _libxx, _u64())
xxh3_free = _extern("XXH3_freeState", _libxx, nt.intc(_u64))
xxh3_reset = _extern("XXH3_64bits_reset", _libxx, nt.intc(_u64))
xxh3_update = _extern("XXH3_64bits_update", _libxx, nt.intc(_u64, _u64, _u64))
xxh3_digest = _extern("XXH3_64bits_digest", _libxx, _u64(_u64))
