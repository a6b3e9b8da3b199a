"""Reading data files in bounded memory: the text check scans blocks, JSONL files stream line by line."""

from __future__ import annotations

import pytest

from meshkd.recipe.corpus import documents


@pytest.mark.parametrize("block", [1, 2, 3, 5, 64])
def test_the_text_check_reads_blocks_and_names_the_first_bad_byte_wherever_blocks_end(block, tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "_SCAN_BYTES", block)
    path = tmp_path / "data.txt"
    path.write_bytes("héllo wörld €uro 𝄞".encode())  # 2-, 3- and 4-byte characters across every block size
    assert documents.not_text(str(path)) is None
    path.write_bytes("héllo".encode() + b"\xff" + "wörld".encode())
    assert documents.not_text(str(path)) == "not valid UTF-8 (byte 0xff at offset 6)"
    path.write_bytes(b"\xffabc\x00")  # a NUL byte anywhere makes it binary, as it did when read whole
    assert documents.not_text(str(path)) == "binary (a NUL byte at offset 4)"
    path.write_bytes("ab€".encode()[:-1])
    assert documents.not_text(str(path)) == "not valid UTF-8 (a character cut at the end, offset 2)"


def test_jsonl_rows_are_read_line_by_line_with_their_line_numbers(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "a"}\r\n\n{"text": "b"}\n{"text": ')
    rows = documents._jsonl_rows(str(path), "replace")
    assert next(rows) == ({"text": "a"}, f"{path}:1")
    assert next(rows) == ({"text": "b"}, f"{path}:3")
    with pytest.raises(ValueError, match=rf"{path}:4: invalid JSON"):
        next(rows)
