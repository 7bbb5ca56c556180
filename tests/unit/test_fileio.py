"""rpc/fileio.py: a large file read in ranges side by side gives the file's bytes, whatever the number of ranges,
and a file that ends early raises the caller's error instead of leaving part of the buffer unread."""

from __future__ import annotations

import os

import pytest

from vitserve.rpc import fileio


class Short(Exception):
    pass


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_a_large_file_reads_whole_in_any_number_of_ranges(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(fileio, "READ_THREADS", threads)
    data = os.urandom(fileio.PARALLEL_MIN_BYTES + 12_345)  # not a multiple of the ranges
    path = tmp_path / "t"
    path.write_bytes(data)
    out = bytearray(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        fileio.read_into(fd, memoryview(out), Short)
    finally:
        os.close(fd)
    assert out == data


@pytest.mark.parametrize("size", [1000, fileio.PARALLEL_MIN_BYTES + 1])
def test_a_short_file_raises_the_callers_error(tmp_path, monkeypatch, size):
    monkeypatch.setattr(fileio, "READ_THREADS", 2)
    path = tmp_path / "t"
    path.write_bytes(b"x" * (size - 1))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(Short):
            fileio.read_into(fd, memoryview(bytearray(size)), Short)
    finally:
        os.close(fd)
