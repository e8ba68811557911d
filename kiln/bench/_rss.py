"""Memory a process holds, for the benchmarks that measure it: resident memory from
``/proc/self`` (``kiln bench memory``, ``parallel``, ``vit``: on CPU the peak that matters) and
the bytes of the storages behind tensors (``kiln bench zero``, ``parallel``)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import torch

from kiln.optim import local_tensor


class Rss:
    """Resident set size of this process in bytes, from ``/proc/self/status``, with the peak
    (``VmHWM``) reset through ``/proc/self/clear_refs`` between measurements."""

    def __init__(self) -> None:
        import ctypes

        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None
        self.peak_reset = True  # False once Linux refused a reset: VmHWM is then the process's peak

    @staticmethod
    def read() -> dict[str, int]:
        text = Path("/proc/self/status").read_text()
        return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.MULTILINE).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}

    def restart(self) -> int:
        """Give freed heap pages back to the OS, reset the peak; return the RSS now (bytes)."""
        gc.collect()
        if self._trim is not None:
            self._trim(0)  # freed memory glibc keeps would be reused without raising the RSS
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to VmRSS (Linux >= 4.0)
        except OSError:
            self.peak_reset = False
        return self.read()["VmRSS"]


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct, allocated storages behind tensors (a DTensor: its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = local_tensor(t).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
