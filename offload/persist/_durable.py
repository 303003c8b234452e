"""Durable file writes, in one place: every file persistence writes is fsynced before it counts, a file that
replaces another is written under a temporary name and renamed into place, and the folder is fsynced after the
rename (what a commit relies on across a crash).

Checkpoint files are private (0600: :func:`write_file`'s default); an export is the artifact others load, so its
files follow the umask, as ``save_pretrained``'s do (:func:`write_temp`). A process killed while it wrote leaves a
hidden ``.NAME.tmp-PID`` file, which the next :func:`write_temp` into that folder removes (a dead pid's only); a
folder a process works in is claimed with nvme_swapper's owner record (:func:`claim_folder`), so whoever finds it
later can tell whether its writer is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import torch

from nvme_swapper import remove_of_dead, write_owner

_TMP = re.compile(r"\..+\.tmp-(\d{1,9})")  # write_temp's files: .NAME.tmp-PID


def _fsync(path: Path, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Makes ``path``'s entries (a rename, a new file) durable across a crash: what a commit relies on."""
    _fsync(path, os.O_DIRECTORY)


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``data`` written into ``path`` (created or truncated) and fsynced; an OSError names the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), mode)
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:  # (the errno kept, the file named)
        raise OSError(exc.errno, f"writing {path}: {os.strerror(exc.errno or 5)}", str(path)) from None


def make_folder(path: Path, what: str, mode: int = 0o777) -> None:
    """``path`` made (with its parents) for ``what`` (the call that writes there); an OSError names both and the
    fix, where pathlib's names only the first missing parent."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{what}: {path} is a file, not a folder; give a folder")
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"{what}: cannot create {path}: {os.strerror(exc.errno or 5)}; give a folder "
                      "this process can write", str(path)) from None


def claim_folder(path: Path) -> None:
    """``path`` created empty (0700) with this process's owner record (host, boot, pid namespace, pid, start
    time), so a later process can tell that its writer was killed; removed again if the record cannot be
    written."""
    path.mkdir(mode=0o700)
    try:
        write_owner(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def write_temp(folder: Path, name: str, tensors: dict[str, torch.Tensor] | None, text: str = "", *,
               torch_file: bool = False) -> Path:
    """``name`` written and fsynced under a temporary name in ``folder``, following the umask; returns that path.
    ``tensors`` as safetensors (as a torch state dict with ``torch_file``), else ``text``. A failure removes the
    temporary file, and an I/O error of safetensors (its own exception type) is raised as the OSError it reports,
    errno included, so a full disk reads the same whatever the writer."""
    from safetensors.torch import save_file

    remove_of_dead(folder, _TMP)  # what a process killed while it wrote here left (any name): its space
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    try:
        if tensors is not None and torch_file:
            with open(tmp, "wb") as f:  # through a file object: a full disk is the OSError of its write (in the
                torch.save(tensors, f)  # chain of torch's container error, which has no path or errno)
            os.chmod(tmp, 0o666 & ~_umask())
        elif tensors is not None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
            os.chmod(tmp, 0o666 & ~_umask())  # safetensors makes its file 0600: an export is read by others
        else:
            tmp.write_text(text)
        _fsync(tmp)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # a full disk gets its space back
        if isinstance(exc, OSError):
            raise
        cause = exc.__cause__ or exc.__context__  # torch's writer: the file's OSError, under its own error
        if isinstance(cause, OSError) and cause.errno:
            raise OSError(cause.errno, f"writing {folder / name}: {os.strerror(cause.errno)}") from exc
        # safetensors reports I/O errors as its own type: "os error 28" (>= 0.6), "Os { code: 28, ..." (0.4-0.5)
        code = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(exc))
        if code is not None:
            raise OSError(int(code.group(1) or code.group(2)), f"writing {folder / name}: {exc}") from exc
        raise
    return tmp


def replace_file(folder: Path, name: str, tensors: dict[str, torch.Tensor], *, torch_file: bool) -> Path:
    """``folder/name`` replaced whole by ``tensors`` (:func:`write_temp`, renamed into place, the folder
    fsynced): a crash leaves the old file or the new one."""
    final = folder / name
    os.replace(write_temp(folder, name, tensors, torch_file=torch_file), final)
    fsync_dir(folder)
    return final


def _umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc; elsewhere set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
