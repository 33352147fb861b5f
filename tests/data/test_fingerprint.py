"""Content fingerprints (data/fingerprint.py): a remembered digest is used only for the very file it was taken of,
so a file edited in place with its size and modification time kept (`touch -r`, `rsync --inplace --times`) is read
again, never taken for the old one. The size threshold is set to 0 so that a small file is remembered."""

from __future__ import annotations

import os
from pathlib import Path

from tuneforge.data import fingerprint as fp


def edit_keeping_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    st = path.stat()
    path.write_bytes(path.read_bytes().replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_file_edited_in_place_with_its_mtime_kept_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "MEMO_MIN_BYTES", 0)
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "the cat sat"}\n' * 50)
    memo = fp.Memo(tmp_path / fp.MEMO_NAME)
    before = memo.digest(path)
    memo.save()
    edit_keeping_size_and_mtime(path, b"cat", b"dog")
    assert fp.Memo(tmp_path / fp.MEMO_NAME).digest(path) != before
    path.write_bytes(b'{"text": "the cat sat"}\n' * 50)
    assert fp.Memo(tmp_path / fp.MEMO_NAME).digest(path) == before  # (the digest is of the content)
