"""opencood.utils.atomic.atomic_write: all or nothing, for every file the project writes."""
from __future__ import annotations

import os
import stat

import pytest

from opencood.utils.atomic import atomic_write


@pytest.mark.parametrize("durable", [False, True])
def test_a_clean_write_replaces_the_file(tmp_path, durable):
    path = tmp_path / "sub" / "out.yaml"
    with atomic_write(path, durable=durable) as stream:
        stream.write("a: 1\n")
    with atomic_write(path, durable=durable) as stream:
        stream.write("a: 2\n")
    assert path.read_text() == "a: 2\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.yaml"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "last.pth"
    path.write_bytes(b"previous")
    with pytest.raises(OSError, match="disk full"):
        with atomic_write(path, "wb", durable=True) as stream:
            stream.write(b"half of the new")
            raise OSError(28, "disk full")
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]


def test_files_get_the_usual_permissions_not_private_ones(tmp_path):
    umask = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "config.yaml") as stream:
            stream.write("x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o644
