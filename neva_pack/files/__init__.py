"""Files written durably and read back, for the sample store and the output formats alike:
Megatron-Core's IndexedDataset (.bin/.idx), an output file that checksums what it writes, and
write-behind. Neither the store nor a format owns them, so neither imports the other for them.
Untrusted files are read here too: settings, and video container headers (video_header)."""

from __future__ import annotations

import os

from neva_pack.files.checksums import data_extents, file_checksum
from neva_pack.files.indexed import BIN_SUFFIX, DTYPE_CODES, IDX_SUFFIX, IndexedReader, IndexedWriter, bin_path, idx_path, is_index, read_index
from neva_pack.files.output_file import OutputFile
from neva_pack.files.remote import STAGING_VARIABLE, Mirrored, RemoteError, RemoteFiles, is_remote, local_copy, location, mirror, pull, redacted, remote_copy, remote_listing, staging_root, url_join
from neva_pack.files.remote_lock import HEARTBEAT_S, LOCK_TIMEOUT_S, RemoteLock, remote_lock_holder
from neva_pack.files.paths import LOCK_FILE, META_SUFFIX, PACKED_NAME, PLAN_SUFFIX, TMP_SUFFIX, checkpoint_paths, meta_path, pack_size_of, packed_prefix, packed_prefixes, plan_path, prefix_file, relative_name, skipped_path, stats_path, store_dir, tmp_prefix, write_json_atomic
from neva_pack.files.untrusted import ANY_SIZE, FileRefused, MAX_OUTPUT_JSON_BYTES, MAX_OUTPUT_TABLE_BYTES, MAX_SETTINGS_BYTES, compression_of, open_file, open_output, open_regular, parse_yaml, read_bytes, read_json, read_text, read_yaml, regular_file_bytes, regular_output
from neva_pack.files.video_header import MAX_VIDEO_FRAMES, MAX_VIDEO_HEADER_BYTES, MAX_VIDEO_PIXELS, VIDEO_HEADER_REASONS, VideoHeader, VideoHeaderError, read_video_header, read_video_header_at, read_video_header_file
from neva_pack.files.write_behind import WriteBehind



def fsync_close(file) -> None:
    """Flush, fsync and close an open file: what it holds is on the disk when this returns."""
    file.flush()
    os.fsync(file.fileno())
    file.close()

__all__ = [
    "ANY_SIZE",
    "BIN_SUFFIX",
    "DTYPE_CODES",
    "FileRefused",
    "HEARTBEAT_S",
    "IDX_SUFFIX",
    "IndexedReader",
    "IndexedWriter",
    "LOCK_FILE",
    "LOCK_TIMEOUT_S",
    "MAX_OUTPUT_JSON_BYTES",
    "MAX_OUTPUT_TABLE_BYTES",
    "MAX_SETTINGS_BYTES",
    "MAX_VIDEO_FRAMES",
    "MAX_VIDEO_HEADER_BYTES",
    "MAX_VIDEO_PIXELS",
    "META_SUFFIX",
    "Mirrored",
    "OutputFile",
    "PACKED_NAME",
    "PLAN_SUFFIX",
    "RemoteError",
    "RemoteFiles",
    "RemoteLock",
    "STAGING_VARIABLE",
    "TMP_SUFFIX",
    "VIDEO_HEADER_REASONS",
    "VideoHeader",
    "VideoHeaderError",
    "WriteBehind",
    "bin_path",
    "checkpoint_paths",
    "compression_of",
    "data_extents",
    "file_checksum",
    "fsync_close",
    "idx_path",
    "is_index",
    "is_remote",
    "local_copy",
    "location",
    "meta_path",
    "mirror",
    "open_file",
    "open_output",
    "open_regular",
    "pack_size_of",
    "packed_prefix",
    "packed_prefixes",
    "parse_yaml",
    "plan_path",
    "prefix_file",
    "pull",
    "read_bytes",
    "read_index",
    "read_json",
    "read_text",
    "read_video_header",
    "read_video_header_at",
    "read_video_header_file",
    "read_yaml",
    "redacted",
    "regular_file_bytes",
    "regular_output",
    "relative_name",
    "remote_copy",
    "remote_listing",
    "remote_lock_holder",
    "skipped_path",
    "staging_root",
    "stats_path",
    "store_dir",
    "tmp_prefix",
    "url_join",
    "write_json_atomic",
]
