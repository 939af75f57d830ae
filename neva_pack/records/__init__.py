"""The input, one record at a time: LLaVA-format records typed at the edge (``parse_record``, every skip
reason), streamed from a JSON list or JSONL (``stream``), the list's scanner and counter, and a sharded
run's record ranges (``shards``).
"""

from neva_pack.records.conversation import Conversation, DEFAULT_MAX_CONVERSATION_CHARS, DEFAULT_MAX_IMAGES_PER_RECORD, DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_RECORD_DEPTH, IMAGES_NOT_HELD, IMAGE_PLACEHOLDER, MAX_RECORD_DEPTH_LIMIT, OVER_IMAGE_BUDGET, PLACEHOLDERS, RawRecord, RecordError, RecordLimits, SKIP_REASONS, Turn, VIDEOS_NOT_READ, VIDEO_PLACEHOLDER, parse_record
from neva_pack.records.list_count import count_list_records
from neva_pack.records.list_scanner import ListScanner
from neva_pack.records.shards import SHARD_LIST_VARIABLE, resolve_shards, shard_range
from neva_pack.records.stream import RecordIndex, count_records, index_records, iter_raw_records, record_ids

__all__ = [
    "Conversation",
    "DEFAULT_MAX_CONVERSATION_CHARS",
    "DEFAULT_MAX_IMAGES_PER_RECORD",
    "DEFAULT_MAX_RECORD_BYTES",
    "DEFAULT_MAX_RECORD_DEPTH",
    "IMAGES_NOT_HELD",
    "IMAGE_PLACEHOLDER",
    "ListScanner",
    "MAX_RECORD_DEPTH_LIMIT",
    "OVER_IMAGE_BUDGET",
    "PLACEHOLDERS",
    "RawRecord",
    "RecordError",
    "RecordIndex",
    "RecordLimits",
    "SHARD_LIST_VARIABLE",
    "SKIP_REASONS",
    "Turn",
    "VIDEOS_NOT_READ",
    "VIDEO_PLACEHOLDER",
    "count_list_records",
    "count_records",
    "index_records",
    "iter_raw_records",
    "parse_record",
    "record_ids",
    "resolve_shards",
    "shard_range",
]
