"""One persistent-cache key per program for every process of a multi-process CPU run.

JAX keys a program in XLA's persistent compilation cache by, among others, a fingerprint of
the devices' topology. XLA:CPU describes only the calling process's own devices there, so
each process of one run computes another key for the same program (seen with
``JAX_DEBUG_LOG_MODULES=jax._src.cache_key``: three ranks, the same program, flags and compile
options, three ``accelerator_config`` hashes). JAX writes the cache from process 0 alone, so
every other process missed it always: a restarted or replacement process compiled its step
again, and so did every rank but 0 of every later run on the same cache.

For a program over CPU devices of several processes, jaxdist keys the devices by what is the
same in every process: each device's id, process and kind, and this host's CPU (XLA:CPU
compiles for the features of the CPU it runs on, which the topology's fingerprint covered).
Every other program keeps JAX's own key. The executable itself does not depend on which
process compiled it: the compile options JAX also hashes carry the whole device assignment.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path

log = logging.getLogger("jaxdist")

_INSTALLED = False


def host_cpu_signature() -> bytes | None:
    """A digest of this host's CPU architecture and feature flags (Linux's ``/proc/cpuinfo``),
    or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), None)
    if flags is None:
        return None
    return hashlib.sha256(f"{platform.machine()}|{' '.join(sorted(flags.split(':', 1)[-1].split()))}".encode()).digest()


def share_cpu_cache_keys() -> bool:
    """Key multi-process CPU programs alike in every process (see the module's docstring).
    False, said in one line, where this JAX or host does not allow it (each process then keeps
    its own key: a replacement compiles again)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    from jax._src import cache_key

    original = getattr(cache_key, "_hash_accelerator_config", None)
    host = host_cpu_signature()
    if original is None or host is None:
        why = "this JAX has no jax._src.cache_key._hash_accelerator_config" if original is None else "/proc/cpuinfo has no CPU flags"
        log.info(f"each process keys its CPU programs in the compile cache on its own ({why}): a restarted rank compiles again")
        return False

    def hash_accelerator_config(hash_obj, accelerators, *args, **kwargs):
        devices = list(getattr(accelerators, "flat", accelerators))
        if not devices or any(d.platform != "cpu" for d in devices) or len({d.process_index for d in devices}) < 2:
            return original(hash_obj, accelerators, *args, **kwargs)
        for device in devices:
            hash_obj.update(f"{device.id}:{device.process_index}:{device.device_kind};".encode())
        hash_obj.update(host)
        return None

    cache_key._hash_accelerator_config = hash_accelerator_config
    _INSTALLED = True
    return True
