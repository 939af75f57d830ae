"""An OutputFile (files/output_file.py) holds exactly what was written and skipped, in order,
and knows its checksum without reading itself back, also when continued from a checkpoint."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.files import OutputFile, file_checksum

steps = st.lists(st.tuples(st.booleans(), st.integers(0, 9000)), min_size=1, max_size=12)


def _expected(chunks) -> bytes:
    return b"".join(b"\0" * n if hole else bytes([n % 251 + 1]) * n for hole, n in chunks)


def _apply(out: OutputFile, chunks) -> None:
    for hole, n in chunks:
        out.skip(n) if hole else out.write(bytes([n % 251 + 1]) * n)


@settings(max_examples=40, deadline=None)
@given(before=steps, after=steps, buffered=st.booleans(), behind=st.booleans())
def test_written_skipped_and_resumed_bytes_read_back_with_their_checksum(tmp_path_factory, before, after, buffered, behind):
    directory = tmp_path_factory.mktemp("out")
    whole = OutputFile(directory / "whole", buffered=buffered, write_behind=behind)
    _apply(whole, before + after)
    whole.close()
    expected = _expected(before + after)
    assert (directory / "whole").read_bytes() == expected
    assert whole.checksum() == file_checksum(directory / "whole")

    first = OutputFile(directory / "resumed", buffered=buffered, write_behind=behind)
    _apply(first, before)
    first.sync()
    checkpoint = first.tell()
    _apply(first, [(False, 100)])  # written after the checkpoint, then lost: the run was killed
    first.abandon()
    resumed = OutputFile(directory / "resumed", resume_at=checkpoint, buffered=buffered, write_behind=behind)
    _apply(resumed, after)
    resumed.close()
    assert (directory / "resumed").read_bytes() == expected
    assert resumed.checksum() == whole.checksum()


def test_a_file_shorter_than_its_checkpoint_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    with pytest.raises(ValueError, match="shorter than its checkpoint"):
        OutputFile(tmp_path / "f", resume_at=10)
