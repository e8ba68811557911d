"""The ranks that ``kiln train --nproc N`` started, found from outside, to kill one of them."""

from __future__ import annotations

from pathlib import Path


def _parent(stat: Path) -> int:
    return int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name)": state, parent


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks under launcher process ``launcher``: its fork server's children,
    each named "kiln rank N" (/proc/PID/comm)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(_parent(stat), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    ranks, todo = {}, list(children.get(launcher, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("kiln rank ") and name[len("kiln rank "):].isdigit():
            ranks[int(name[len("kiln rank "):])] = pid
    return ranks
