"""Who owns a folder a process leaves on disk while it runs (a swap engine's ``swap-*``), so that one left behind
by a process that ended without cleaning up (SIGKILL, a preempted node) can be told from one in use and removed.

The owner is written into the folder when it is made: host, boot, pid namespace, pid and the pid's start time (a
pid reused by a later process is not the owner). A folder is left behind only when its owner ran on this host,
since this boot, in this pid namespace (containers sharing a host and a disk see their own pids), and is gone; a
folder without a full owner record (another version, one being made, /proc missing) is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path

log = logging.getLogger(__name__)

OWNER = ".owner"


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (another user's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # another user's process, or not a pid at all: leave it
    return True


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _machine() -> dict[str, object] | None:
    """What says "this host, this boot, this pid namespace"; None where /proc cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return {"host": socket.gethostname(), "boot": boot, "pidns": pidns}


def write_owner(folder: Path) -> None:
    """Marks ``folder`` as this process's (nothing where /proc cannot identify it: never removed then)."""
    machine = _machine()
    if machine is None:
        return
    pid = os.getpid()
    fd = os.open(folder / OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    with os.fdopen(fd, "w") as f:  # (0600 whatever the umask, as the swap file)
        f.write(json.dumps({**machine, "pid": pid, "start": _start_time(pid)}))


def left_behind(folder: Path) -> bool:
    """Whether ``folder``'s owner record says it ran on this host, since this boot, in this pid namespace, and has
    ended (a folder without a full record: False)."""
    try:
        owner = json.loads((folder / OWNER).read_text())
        pid, start = int(owner["pid"]), owner["start"]
        here = {k: owner[k] for k in ("host", "boot", "pidns")}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if here != _machine():
        return False
    return not alive(pid) or (start is not None and _start_time(pid) not in (None, start))


def remove_of_dead(parent: Path, pattern: re.Pattern[str]) -> None:
    """Removes the entries of ``parent`` whose name ``pattern`` matches with a process id as its first group, where
    that process has ended: what a writer killed midway left under a temporary name (a file or a folder)."""
    for entry in parent.iterdir():
        found = pattern.fullmatch(entry.name)
        if found and not alive(int(found.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()


def remove_left_behind(parent: Path, pattern: str = "swap-*") -> list[Path]:
    """Removes the folders matching ``pattern`` in ``parent`` whose owner ended without removing them; returns
    them (logged: the space comes back before anything is measured or reserved there)."""
    removed = []
    for folder in sorted(parent.glob(pattern)):
        if folder.is_dir() and not folder.is_symlink() and left_behind(folder):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():  # (another user's cannot be removed: not reported as removed)
                removed.append(folder)
                log.warning("nvme_swapper: removed %s, left by a process that ended without closing its swap "
                            "engine", folder)
    return removed
