"""The tools a user runs on an output: ``stats`` (and the run report it reads), ``plan`` (other pack sizes
and algorithms from the stored lengths), ``verify`` (every checksum and invariant) and ``convert``.
"""

from neva_pack.commands.conversion import convert
from neva_pack.commands.plan import CUT_ROW, SampleLengths, explore, format_table, load_lengths
from neva_pack.commands.report import AlgorithmSuggestion, BalanceReport, ClipStats, CountSummary, PackingStats, PaddingStats, Percentiles, RecordCounts, RunReport, read_report
from neva_pack.commands.balance import balance_report, step_balance
from neva_pack.commands.stats import PackingArrays, arrays_from_plan, format_summary, global_batch_size_advice, load_outputs, packing_stats, plot, stats_figure, training_overrides, with_batch_size
from neva_pack.commands.verification import verify

__all__ = [
    "balance_report",
    "step_balance",
    "AlgorithmSuggestion",
    "BalanceReport",
    "ClipStats",
    "CUT_ROW",
    "CountSummary",
    "PackingArrays",
    "PackingStats",
    "PaddingStats",
    "Percentiles",
    "RecordCounts",
    "RunReport",
    "SampleLengths",
    "arrays_from_plan",
    "convert",
    "explore",
    "format_summary",
    "format_table",
    "global_batch_size_advice",
    "load_lengths",
    "load_outputs",
    "packing_stats",
    "stats_figure",
    "plot",
    "read_report",
    "training_overrides",
    "verify",
    "with_batch_size",
]
