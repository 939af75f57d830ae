"""Alignment padding for Megatron-Core THD (--pad_to_multiple_of, CP/TP/SP): the padding contract.

A sample of real length l packed with alignment M occupies p = ceil(l / M) * M positions: its l
tokens, then p - l positions holding the pad id with ignored labels. cu_seqlens holds the padded
boundaries, the plan table and ``cu_seqlens_unpadded`` the real lengths; packs still fit
max_seq_length, and a sample too long for the aligned capacity is cut (never inside an image run).
"""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from neva_pack.cli import main
from neva_pack.config import PreprocessConfig
from neva_pack.reading import PackedSeqDataset
from neva_pack.core import ConfigError
from neva_pack.commands import SampleLengths, explore, verify
from neva_pack.packing import ALGORITHMS, aligned_capacity, alignment_multiple, padded_lengths
from neva_pack.files import meta_path, packed_prefix, plan_path, stats_path
from tests.conftest import SAMPLE_DATA

ENCODER = "openai/clip-vit-base-patch32"  # 49 positions per image: small, fast packs


def preprocess_args(output_dir, *extra):
    return [
        "preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
        "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
        "--output_dir", str(output_dir), "--conv_template", "v1", "--num_workers", "0",
        "--hf_vision_encoder", ENCODER, *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "explicit, cp, tp, sp, expected",
    [
        (None, 1, 1, False, 1),
        (8, 1, 1, False, 8),
        (None, 2, 1, False, 4),  # 2·CP
        (None, 1, 4, True, 4),  # CP·TP with sequence parallel
        (None, 2, 4, False, 4),  # TP alone needs nothing
        (None, 2, 4, True, 8),  # lcm(4, 8)
        (None, 3, 2, True, 6),  # lcm(6, 6)
        (16, 3, 1, False, 48),  # lcm(16, 6)
    ],
)
def test_alignment_multiple_is_the_lcm_of_what_each_parallelism_needs(explicit, cp, tp, sp, expected):
    assert alignment_multiple(explicit, cp, tp, sp) == expected


@given(st.lists(st.integers(1, 10_000), max_size=50), st.integers(1, 128))
def test_padded_lengths_round_up_to_the_next_multiple(lengths, multiple):
    padded = padded_lengths(lengths, multiple)
    lengths = np.asarray(lengths, dtype=np.int64)
    assert np.all(padded % multiple == 0)
    assert np.all((padded >= lengths) & (padded < lengths + multiple))
    assert np.array_equal(padded_lengths(lengths, 1), lengths)


@given(st.integers(1, 100_000), st.integers(1, 512))
def test_the_aligned_capacity_is_the_longest_length_that_fits_once_padded(capacity, multiple):
    cut = aligned_capacity(capacity, multiple)
    assert cut % multiple == 0 and padded_lengths([cut], multiple)[0] == cut <= capacity
    assert padded_lengths([cut + 1], multiple)[0] > capacity


def test_config_derives_the_multiple_and_refuses_one_larger_than_a_pack(tmp_path):
    base = dict(data_path=SAMPLE_DATA / "llava_sample.json", tokenizer_path=SAMPLE_DATA / "tokenizer.model", output_dir=tmp_path)
    config = PreprocessConfig(**base, context_parallel_size=2, tensor_parallel_size=4, sequence_parallel=True)
    assert config.alignment == 8
    with pytest.raises(ConfigError, match="multiple of 64 .* packs of 32 positions"):
        PreprocessConfig(**base, max_seq_length=32, pad_to_multiple_of=64)
    for name in ("pad_to_multiple_of", "context_parallel_size", "tensor_parallel_size", "balance_data_parallel"):
        with pytest.raises(ConfigError, match=f"--{name} 0: must be >= 1"):
            PreprocessConfig(**base, **{name: 0})


def test_parallel_sizes_are_read_from_a_nemo_config(tmp_path, capsys):
    hparams = tmp_path / "neva.yaml"
    hparams.write_text("model:\n  context_parallel_size: 2\n  tensor_model_parallel_size: 2\n  sequence_parallel: true\n")
    out = tmp_path / "out"
    assert main(preprocess_args(out, "--max_seq_length", "1024", "--hparams_file", str(hparams))) == 0
    assert json.loads(meta_path(packed_prefix(out)).read_text())["pad_to_multiple_of"] == 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same data packed without and with alignment to 64 (large, so padding is visible)."""
    root = tmp_path_factory.mktemp("alignment")
    assert main(preprocess_args(root / "plain", "--max_seq_length", "1024")) == 0
    assert main(preprocess_args(root / "m64", "--max_seq_length", "1024", "--pad_to_multiple_of", "64")) == 0
    return {name: root / name for name in ("plain", "m64")}


def _samples_by_record(directory):
    """record index -> (tokens, labels) of each real sample, read back from the packs."""
    ds = PackedSeqDataset(packed_prefix(directory))
    table = np.load(plan_path(packed_prefix(directory)))
    found = {}
    for p in range(len(ds)):
        item = ds[p]
        records = table["record_index"][table["offsets"][p] : table["offsets"][p + 1]]
        starts, real = item["cu_seqlens"][:-1].numpy(), np.diff(item["cu_seqlens_unpadded"].numpy())
        for record, start, length in zip(records, starts, real):
            found[int(record)] = (item["tokens"][start : start + length].numpy(), item["labels"][start : start + length].numpy())
    return found


def test_padded_packs_hold_the_same_samples_followed_by_pad_positions(runs):
    ds = PackedSeqDataset(packed_prefix(runs["m64"]))
    assert ds.pad_to_multiple_of == 64 and ds.pad_id == 0
    padding_seen = 0
    for p in range(len(ds)):
        item = ds[p]
        cu, real = item["cu_seqlens"].long(), item["cu_seqlens_unpadded"].long()
        padded_sizes, real_sizes = np.diff(cu.numpy()), np.diff(real.numpy())
        assert np.all(padded_sizes % 64 == 0) and np.all(padded_sizes - real_sizes < 64) and cu[-1] <= 1024
        assert cu[-1] == len(item["tokens"]) == len(item["labels"])
        for start, length, end in zip(cu[:-1], real_sizes, cu[1:]):
            assert np.all(item["tokens"][start + length : end].numpy() == 0)
            assert np.all(item["labels"][start + length : end].numpy() == -1)
            padding_seen += int(end - start - length)
    assert padding_seen > 0
    plain, padded = _samples_by_record(runs["plain"]), _samples_by_record(runs["m64"])
    assert sorted(plain) == sorted(padded) == list(range(20))
    for record, (tokens, labels) in plain.items():
        assert np.array_equal(padded[record][0], tokens) and np.array_equal(padded[record][1], labels)


def test_without_padding_both_cu_seqlens_agree(runs):
    ds = PackedSeqDataset(packed_prefix(runs["plain"]))
    for p in range(len(ds)):
        assert np.array_equal(ds[p]["cu_seqlens"], ds[p]["cu_seqlens_unpadded"])


def test_plan_table_meta_and_stats_record_the_padding(runs, capsys):
    table = np.load(plan_path(packed_prefix(runs["m64"])))
    assert np.array_equal(table["padded_length"], padded_lengths(table["length"], 64))
    meta = json.loads(meta_path(packed_prefix(runs["m64"])).read_text())
    assert meta["pad_to_multiple_of"] == 64 and meta["pad_id"] == 0
    padding = json.loads(stats_path(runs["m64"]).read_text())["packing"]["padding"]
    pad = int(table["padded_length"].sum() - table["length"].sum())
    assert padding == {"pad_to_multiple_of": 64, "positions": pad, "overhead": pad / table["length"].sum()}
    assert main(["stats", str(runs["m64"])]) == 0
    assert f"padding        {pad:>10,}   positions to align samples to a multiple of 64" in capsys.readouterr().out
    plain = json.loads(stats_path(runs["plain"]).read_text())["packing"]["padding"]
    assert plain == {"pad_to_multiple_of": 1, "positions": 0, "overhead": 0.0}


def test_verify_checks_the_padding(runs, tmp_path):
    import shutil

    assert verify(runs["m64"], progress=False).ok
    broken = tmp_path / "broken"
    shutil.copytree(runs["m64"], broken)
    table = dict(np.load(plan_path(packed_prefix(broken))))
    table["length"] = table["length"] - 1  # claims one real token less: a real token where padding should be
    np.savez(plan_path(packed_prefix(broken)), **table)
    problems = " ".join(verify(broken, progress=False).problems)
    assert "checksum mismatch" in problems and "padding position" in problems and "not 0 / -1" in problems


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_packs_padded_lengths_and_cuts_what_does_not_fit_aligned(algorithm, tmp_path):
    """Packs of 200 aligned to 64: a sample of 202 positions (two 49-position images) is cut to at
    most 192 so that its padded length fits, right before an image run, never inside one."""
    out = tmp_path / "out"
    args = ["--max_seq_length", "200", "--pad_to_multiple_of", "64", "--packing_algorithm", algorithm]
    assert main(preprocess_args(out, *args)) == 0
    assert verify(out, progress=False).ok  # images match runs, padding holds pad id / ignore
    table = np.load(plan_path(packed_prefix(out)))
    loads = np.add.reduceat(table["padded_length"], table["offsets"][:-1])
    assert loads.max() <= 200 and table["length"].max() <= 192
    stats = json.loads(stats_path(out).read_text())
    assert stats["records"]["truncated"] >= 1 and stats["records"]["packed"] == 20


def test_plan_packs_padded_lengths_cut_to_the_aligned_capacity():
    lengths = SampleLengths(lengths=np.array([5, 11, 3, 16, 20]), truncated=0, cut_at=None, source="golden")
    (row,) = explore(lengths, [16], ["first_fit_shuffle"], pad_to_multiple_of=8)
    # cut to 16, padded to [8, 16, 8, 16, 16]: 64 positions for 51 real ones
    assert (row.pad_to_multiple_of, row.clipped, row.lower_bound) == (8, 1, 4)
    assert row.padding_overhead == 13 / 51 and row.efficiency == 64 / (16 * row.packs)
    (unpadded,) = explore(lengths, [16], ["first_fit_shuffle"])
    assert (unpadded.pad_to_multiple_of, unpadded.padding_overhead, unpadded.lower_bound) == (1, 0.0, 4)


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.integers(1, 64), st.sampled_from([512, 1000, 2048]))
def test_plan_lower_bound_and_overhead_are_those_of_the_padded_cut_lengths(values, multiple, size):
    lengths = SampleLengths(lengths=np.array(values), truncated=0, cut_at=None, source="property")
    (row,) = explore(lengths, [size], ["first_fit_shuffle"], pad_to_multiple_of=multiple)
    real = np.minimum(np.array(values), aligned_capacity(size, multiple))
    padded = padded_lengths(real, multiple)
    assert row.lower_bound == -(-int(padded.sum()) // size) <= row.packs
    assert row.padding_overhead == pytest.approx((padded.sum() - real.sum()) / real.sum())
    assert row.clipped == int((np.array(values) > aligned_capacity(size, multiple)).sum())


def test_plan_defaults_to_the_outputs_multiple_and_takes_the_run_flags(runs, tmp_path, capsys):
    def plan(target, *flags):
        assert main(["plan", str(target), "--pack_sizes", "1024", "--algorithms", "first_fit_shuffle", "--json", *flags]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        return row

    stats = json.loads(stats_path(runs["m64"]).read_text())
    assert stats["algorithm"] == "first_fit_shuffle" and stats["seed"] == 0
    from_store = plan(runs["m64"])  # the output's meta records 64: the plan packs what the run packed
    assert from_store["pad_to_multiple_of"] == 64 and from_store["packs"] == stats["packing"]["packs"]
    assert from_store["padding_overhead"] == pytest.approx(stats["packing"]["padding"]["overhead"])
    without_store = tmp_path / "m64"
    without_store.mkdir()
    for path in runs["m64"].glob(packed_prefix(runs["m64"]).name + ".*"):
        (without_store / path.name).write_bytes(path.read_bytes())
    assert plan(without_store) | {"seconds": 0} == from_store | {"seconds": 0}  # from the plan table and the meta
    # the run's flags, through the run's lcm rule: 64 from an explicit multiple or from CP 32
    for flags in (["--pad_to_multiple_of", "64"], ["--context_parallel_size", "32"],
                  ["--context_parallel_size", "4", "--tensor_parallel_size", "16", "--sequence_parallel"]):  # fmt: skip
        assert plan(runs["plain"], *flags) | {"seconds": 0} == from_store | {"seconds": 0}, flags
    unpadded = plan(runs["m64"], "--pad_to_multiple_of", "1")
    assert unpadded | {"seconds": 0} == plan(runs["plain"]) | {"seconds": 0}
    assert unpadded["pad_to_multiple_of"] == 1 and unpadded["padding_overhead"] == 0.0
    assert main(["plan", str(runs["m64"]), "--pack_sizes", "1024"]) == 0
    text = capsys.readouterr().out
    assert "pad %" in text and "samples padded to a multiple of 64 before packing" in text
    assert main(["plan", str(runs["plain"]), "--pack_sizes", "1024", "--pad_to_multiple_of", "0"]) == 2
    assert "--pad_to_multiple_of 0: must be >= 1" in capsys.readouterr().err


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6), multiple=st.integers(1, 8))
def test_with_padding_puts_each_sample_at_its_padded_offset(lengths, multiple):
    """The vectorised padding equals the per-sample definition: sample, then fill up to its padded length."""
    from neva_pack.packing import with_padding

    lengths = np.array(lengths, dtype=np.int64)
    padded = padded_lengths(lengths, multiple)
    values = np.arange(1, int(lengths.sum()) + 1, dtype=np.int32)
    pieces = np.split(values, np.cumsum(lengths)[:-1])
    expected = np.concatenate([np.append(p, np.full(n - len(p), -7, np.int32)) for p, n in zip(pieces, padded)])
    got = with_padding(values, lengths, padded, -7)
    assert got.dtype == np.int32 and got.tolist() == expected.tolist()
