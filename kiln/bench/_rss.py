"""Resident memory of this process for the benchmarks that measure whole runs per rank
(``kiln bench parallel``, ``kiln bench vit``), where CPU memory is the peak that matters."""

from __future__ import annotations

import gc
import re
from pathlib import Path


class Rss:
    """Resident set size of this process in bytes, from ``/proc/self/status``, with the peak
    (``VmHWM``) reset through ``/proc/self/clear_refs`` between measurements."""

    def __init__(self) -> None:
        import ctypes

        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    @staticmethod
    def read() -> dict[str, int]:
        text = Path("/proc/self/status").read_text()
        return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.MULTILINE).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}

    def restart(self) -> int:
        """Give freed heap pages back to the OS, reset the peak; return the RSS now (bytes)."""
        gc.collect()
        if self._trim is not None:
            self._trim(0)  # freed memory glibc keeps would be reused without raising the RSS
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to VmRSS (Linux >= 4.0)
        return self.read()["VmRSS"]
