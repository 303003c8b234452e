"""nvme_swapper's C helper in the build cache: one build per source, found by its content wherever it is installed,
announced while it runs and silent on a cache hit. (The CPU Adam kernel's cache: tests/test_cpu_adam.py.)"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from nvme_swapper import _native

BUILDING = "nvme_swapper: building its C helper"


def test_the_c_helper_is_built_once_per_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A copy of the same source elsewhere (another install) loads the first one's build; a changed source gets a
    build of its own; only a build logs."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="nvme_swapper"):
        assert _native._build().swp_hash_isa()
    assert caplog.text.count(BUILDING) == 1
    (built,) = (tmp_path / "cache" / "nvme_swapper").glob("aio-*.so")
    inode = built.stat().st_ino
    other = tmp_path / "other" / "_aio.c"
    other.parent.mkdir()
    shutil.copyfile(_native._SOURCE, other)
    monkeypatch.setattr(_native, "_SOURCE", other)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nvme_swapper"):
        _native._build()
    assert BUILDING not in caplog.text and built.stat().st_ino == inode
    other.write_text(other.read_text() + "\n/* another version */\n")
    with caplog.at_level(logging.WARNING, logger="nvme_swapper"):
        _native._build()
    assert caplog.text.count(BUILDING) == 1
    assert len(list((tmp_path / "cache" / "nvme_swapper").glob("aio-*.so"))) == 2
