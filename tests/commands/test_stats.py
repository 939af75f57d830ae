"""neva-pack stats (text, JSON, plot, foreign prefixes), neva-pack plan, and several --pack_sizes (each with its own skips)."""

import json
import shutil
import struct

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.pipeline import ownership, size_skip_details, write_size_skipped
from neva_pack.reading import PackedSeqDataset
from neva_pack.core import ConfigError
from neva_pack.files import (
    bin_path, idx_path, meta_path, packed_prefix, plan_path, relative_name, skipped_path, stats_path
)
from neva_pack.commands import (
    AlgorithmSuggestion, BalanceReport, CountSummary, PackingArrays, PackingStats, PaddingStats, Percentiles,
    RecordCounts, RunReport, explore, format_summary, load_lengths, packing_stats, stats_figure, with_batch_size
)
from neva_pack.packing import pack
from tests.conftest import SAMPLE_DATA


def preprocess_args(output_dir, *extra):
    return [
        "preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
        "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
        "--output_dir", str(output_dir), "--conv_template", "v1", "--num_workers", "0", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "out"
    assert main(preprocess_args(out, "--max_seq_length", "2048")) == 0
    return out


def test_stats_report_matches_the_end_of_run_summary(output, capsys):
    assert main(["stats", str(output), "--global_batch_size", "128"]) == 0
    text = capsys.readouterr().out
    stats = json.loads(stats_path(output).read_text())
    assert "records                20   packed 20   skipped 0   truncated 0" in text
    assert f"packs          {stats['packing']['packs']:>10,}   lower bound" in text
    assert "pack fill      min" in text and "  text         min" in text and "  image        min" in text
    expected_gbs = max(1, round(128 / stats["packing"]["samples_per_pack"]["mean"]))
    assert f"model.global_batch_size={expected_gbs}" in text
    assert "++model.data.crop_size=[336,336]" in text


def test_stats_json_is_the_same_report(output, capsys):
    assert main(["stats", str(packed_prefix(output)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(stats_path(output).read_text())


def test_plot_is_a_png_of_sensible_size(output, tmp_path, capsys):
    png = tmp_path / "stats.png"
    assert main(["stats", str(output), "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert 1000 <= width <= 3000 and 300 <= height <= 1200 and len(data) > 20_000


def _arrays(lengths_per_pack: list[list[int]], capacity: int) -> PackingArrays:
    lengths = np.array([n for pack_lengths in lengths_per_pack for n in pack_lengths], dtype=np.int64)
    offsets = np.cumsum([0] + [len(p) for p in lengths_per_pack]).astype(np.int64)
    return PackingArrays(capacity=capacity, offsets=offsets, lengths=lengths, num_images=None, image_positions=None,
                         pack_images=np.zeros(len(lengths_per_pack), dtype=np.int64))


@pytest.mark.parametrize("samples, log_scale", [(20, False), (20_000, True)])
def test_plot_counts_on_a_log_axis_only_when_counts_span_decades(samples, log_scale):
    """At small counts a log axis hides bars of one or two samples and labels ticks 6x10^0: there the
    lengths panel is linear with integer ticks; at large counts it is log, starting below 1 so a bar
    of one sample still shows, with plain tick labels."""
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(samples)
    lengths = rng.integers(50, 1200, size=samples).tolist()
    packs = [lengths[i:i + 3] for i in range(0, samples, 3)]
    fig = stats_figure(_arrays(packs, 4096), "t")
    lengths_ax = fig.axes[0]
    try:
        assert (lengths_ax.get_yscale() == "log") is log_scale
        if log_scale:
            assert lengths_ax.get_ylim()[0] < 1
        else:
            assert all(float(tick).is_integer() for tick in lengths_ax.get_yticks())
        fig.canvas.draw()
        labels = [label.get_text() for label in lengths_ax.get_yticklabels() if label.get_text()]
        assert labels and not any("times" in label or "^" in label for label in labels), labels
    finally:
        plt.close(fig)


def test_stats_of_a_prefix_without_meta_reads_the_index(output, tmp_path, capsys):
    """A prefix as NeMo's own script writes it: only .bin/.idx."""
    foreign = tmp_path / "nemo"
    foreign.mkdir()
    for file_of in (bin_path, idx_path):
        shutil.copy(file_of(packed_prefix(output)), file_of(packed_prefix(foreign)))
    assert main(["stats", str(foreign)]) == 2
    assert "pass --crop_size H W" in capsys.readouterr().err
    assert main(["stats", str(foreign), "--crop_size", "336", "336", "--max_seq_length", "2048", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ours = json.loads(stats_path(output).read_text())
    for key in ("packs", "lower_bound_packs", "efficiency", "samples", "images", "positions", "samples_per_pack"):
        assert report["packing"][key] == ours["packing"][key], key
    assert report["records"] is None and report["packing"]["text_positions"] is None
    assert list(report) == list(ours) and report["algorithm"] is None and report["dataset"] is None  # same keys, unknowns null


def test_stats_of_an_output_without_its_stats_file_rebuilds_the_report_from_meta_and_plan(output, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(output, copy)
    stats_path(copy).unlink()
    assert main(["stats", str(copy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ours = json.loads(stats_path(output).read_text())
    assert list(report) == list(ours) and report["packing"] == ours["packing"]
    assert report["records"] == ours["records"] and report["algorithm"] == ours["algorithm"] and report["seed"] == ours["seed"]
    assert report["output_format"] == "nemo" and report["image_positions"] == ours["image_positions"]
    assert report["seconds"] is None and report["data_prefix"] == str(packed_prefix(copy))


def test_packing_stats_golden():
    arrays = PackingArrays(
        capacity=10, offsets=np.array([0, 2, 3]), lengths=np.array([6, 4, 5]), num_images=np.array([1, 0, 0]),
        image_positions=3, pack_images=np.array([1, 0]),
    )  # fmt: skip
    stats = packing_stats(arrays)
    assert stats.packs == 2 and stats.lower_bound_packs == 2 and stats.efficiency == 0.75
    assert stats.pack_fill.min == 0.5 and stats.pack_fill.max == 1.0
    assert stats.samples_per_pack == CountSummary(mean=1.5, min=1, max=2)
    assert stats.text_positions.max == 5 and stats.image_positions_per_sample.max == 3
    assert stats.samples_with_images == 1 and stats.padding == PaddingStats(pad_to_multiple_of=1, positions=0, overhead=0.0)


def test_a_runs_stats_json_round_trips_through_the_typed_report(output):
    """stats.json is RunReport.to_json(): reading and writing it back gives the same keys, values and order."""
    text = stats_path(output).read_text()
    data = json.loads(text)
    report = RunReport.from_json(data)
    assert isinstance(report.packing, PackingStats) and isinstance(report.packing.sample_length, Percentiles)
    assert report.to_json() == data
    assert list(report.to_json()) == list(data) and list(report.to_json()["packing"]) == list(data["packing"])
    assert json.dumps(report.to_json(), indent=2) + "\n" == text  # byte for byte what the run wrote


def test_an_older_stats_json_without_the_newer_optional_fields_still_loads(output, capsys):
    """Before --pad_to_multiple_of, --balance_data_parallel and --output_format a stats.json had no
    padding, balance, image_positions, output_format, GBS or seconds: it reads as a run without them."""
    data = json.loads(stats_path(output).read_text())
    for key in ("balance", "image_positions", "output_format", "global_batch_size", "packed_global_batch_size", "seconds"):
        del data[key]
    del data["packing"]["padding"]
    report = RunReport.from_json(data)
    assert report.balance is None and report.output_format is None and report.seconds is None
    assert report.packing.padding == PaddingStats(pad_to_multiple_of=1, positions=0, overhead=0.0)
    assert report.packing.packs == data["packing"]["packs"]
    assert "padding" not in format_summary(report) and "train with:" in format_summary(report)
    restored = report.to_json()
    assert {key: restored[key] for key in data} == data | {"packing": restored["packing"]}
    assert restored["packing"] == data["packing"] | {"padding": {"pad_to_multiple_of": 1, "positions": 0, "overhead": 0.0}}


def test_a_report_with_every_optional_part_round_trips():
    """Suggestion and balance, absent from the sample run, are typed and written back as they were read."""
    arrays = PackingArrays(
        capacity=10, offsets=np.array([0, 2, 3]), lengths=np.array([6, 4, 5]), num_images=np.array([1, 0, 0]),
        image_positions=3, pack_images=np.array([1, 0]), padded_lengths=np.array([6, 4, 6]), pad_to_multiple_of=2,
    )  # fmt: skip
    report = RunReport(
        dataset="d.json", records=RecordCounts(total=4, packed=3, skipped=1, truncated=0, skipped_by_reason={"bad": 1}),
        packing=packing_stats(arrays), algorithm="first_fit_shuffle", seed=3,
        suggestion=AlgorithmSuggestion(algorithm="near_optimal", packs=1, saving=0.5),
        balance=BalanceReport(data_parallel=2, attention_overhead_before=0.5, attention_overhead_after=0.1,
                              tokens_overhead_before=0.4, tokens_overhead_after=0.2, images_overhead_before=1.0,
                              images_overhead_after=0.0),
        max_seq_length=10, image_positions=3, output_format="compact", data_prefix="o/packed_seq_dataset",
        crop_size=[4, 4], global_batch_size=8, packed_global_batch_size=5, training_overrides=["a=b"], seconds=1.5,
    )  # fmt: skip
    data = json.loads(json.dumps(report.to_json()))
    assert RunReport.from_json(data) == report and RunReport.from_json(data).to_json() == data
    assert data["packing"]["padding"] == {"pad_to_multiple_of": 2, "positions": 1, "overhead": 1 / 15}
    assert data["suggestion"] == {"algorithm": "near_optimal", "packs": 1, "saving": 0.5}
    assert list(data["balance"])[:3] == ["data_parallel", "attention_overhead_before", "attention_overhead_after"]
    summary = format_summary(report)
    assert "padding                 1   positions to align samples to a multiple of 2 (+6.67% over the real positions)" in summary
    assert "balance        N = 2 ranks" in summary and "attention 50.00% -> 10.00%" in summary
    assert "hint           --packing_algorithm near_optimal would need 1 packs (50.0% fewer)" in summary
    assert with_batch_size(report, 16).packed_global_batch_size == round(16 / 1.5)


def test_plan_explores_sizes_from_the_store(output, capsys):
    assert main(["plan", str(output), "--pack_sizes", "1024", "2048", "4096", "--global_batch_size", "64"]) == 0
    text = capsys.readouterr().out
    lengths = load_lengths(output)
    assert f"20 samples from {packed_prefix(output)}" in text
    rows = explore(lengths, [1024, 2048, 4096], ["first_fit_shuffle", "near_optimal"], global_batch_size=64)
    long = int((lengths.lengths > 1024).sum())
    assert long > 0
    for row in rows:
        # counted as a run's report counts them: a sample the cut leaves untrained is skipped, not truncated
        assert (row.clipped, row.skipped) == ((long - 2, 2) if row.pack_size == 1024 else (0, 0))
        clipped_bound = -(-int(np.minimum(lengths.lengths, row.pack_size).sum()) // row.pack_size)
        if row.pack_size == 1024:  # a run cuts before the image run that does not fit, and skips what is left untrained
            assert row.packs >= row.lower_bound < clipped_bound
        else:
            assert row.packs >= row.lower_bound == clipped_bound
        assert row.packed_global_batch_size == max(1, round(64 / row.samples_per_pack_mean))
        line = f"{row.pack_size:>7}  {row.algorithm:<21}{row.packs:>10,}{row.lower_bound:>10,}{100 * row.efficiency:>8.2f}"
        assert line in text


def test_plan_falls_back_to_the_plan_table_without_the_store(output, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(output, copy)
    shutil.rmtree(packed_prefix(copy))
    assert main(["plan", str(copy), "--pack_sizes", "4096", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and rows[0]["pack_size"] == 4096
    # at the run's own size the table's samples are the run's, fed to the packer in input order as the
    # run fed them (the table lists them in pack order): a seeded shuffle packs them as the run did
    run_packs = json.loads(stats_path(output).read_text())["packing"]["packs"]
    for source in (output, copy):
        assert main(["plan", str(source), "--pack_sizes", "2048", "--algorithms", "first_fit_shuffle", "--json"]) == 0
        [row] = json.loads(capsys.readouterr().out)
        assert row["packs"] == run_packs, source
    in_pack_order = np.load(plan_path(packed_prefix(copy)))["length"]
    assert pack(in_pack_order, 2048, algorithm="first_fit_shuffle", seed=0).num_bins != run_packs  # the order matters here


def test_several_pack_sizes_write_one_prefix_each_from_one_store(tmp_path, capsys):
    out = tmp_path / "multi"
    data = str(SAMPLE_DATA / "llava_sample.json")
    assert main(preprocess_args(out, "--pack_sizes", "1024", "2048", "--packing_algorithm", "near_optimal")) == 0
    summary = capsys.readouterr().out
    assert "== pack size 1024" in summary and "== pack size 2048" in summary
    assert [stats_path(out, size).is_file() for size in (None, 1024, 2048)] == [False, True, True]
    small = json.loads(stats_path(out, 1024).read_text())
    big = json.loads(stats_path(out, 2048).read_text())
    # the two 2-image records: 1024 cuts them before their second image and their only answer, so
    # that size skips them (as a run at 1024 does); 2048 packs them whole
    assert small["records"] | {"skipped_by_reason": None} == {
        "total": 20, "packed": 18, "skipped": 2, "truncated": 0, "skipped_by_reason": None}  # fmt: skip
    assert small["records"]["skipped_by_reason"] == {"no_supervised_tokens": 2}
    assert big["records"]["packed"] == 20 and big["records"]["skipped"] == 0 and big["records"]["truncated"] == 0
    own = [json.loads(line) for line in skipped_path(out, 1024).read_text().splitlines()]
    assert [line["reason"] for line in own] == ["no_supervised_tokens"] * 2
    assert all("pack size 1024" in line["detail"] for line in own)
    assert skipped_path(out, 2048).read_text() == skipped_path(out).read_text() == ""
    unsupervised = {line["index"] for line in own}
    small_plan = np.load(plan_path(packed_prefix(out, 1024)))
    big_plan = np.load(plan_path(packed_prefix(out, 2048)))
    assert unsupervised.isdisjoint(small_plan["record_index"].tolist())
    assert unsupervised <= set(big_plan["record_index"].tolist())
    meta = json.loads(meta_path(packed_prefix(out, 1024)).read_text())
    assert relative_name(out, skipped_path(out, 1024)) in meta["checksums"]["files"] and meta["counts"]["skipped"] == 2
    # every prefix accounts for every input record, through its own skipped list
    for target in (packed_prefix(out, 1024), packed_prefix(out, 2048), out):
        assert main(["verify", "--quiet", str(target), "--data_path", data]) == 0
    for size in (1024, 2048):
        for pack in PackedSeqDataset(packed_prefix(out, size)):
            assert len(pack["tokens"]) <= size
    assert main(["stats", str(packed_prefix(out, 1024))]) == 0
    assert "records                20   packed 18   skipped 2   truncated 0" in capsys.readouterr().out
    # plan, from the store, cuts and skips at 1024 as the run did: the same packs
    assert main(["plan", str(out), "--pack_sizes", "1024", "--algorithms", "near_optimal", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["packs"] == small["packing"]["packs"] and row["lower_bound"] == small["packing"]["lower_bound_packs"]
    assert (row["clipped"], row["skipped"]) == (small["records"]["truncated"], small["records"]["skipped"])
    # the small prefix is what a run at 1024 alone writes: the same packs, the same skips
    single = tmp_path / "single"
    assert main(preprocess_args(single, "--max_seq_length", "1024", "--packing_algorithm", "near_optimal",
                                "--max_skip_fraction", "1")) == 0  # fmt: skip
    single_skips = [json.loads(line) for line in skipped_path(single).read_text().splitlines()]
    named = [(line["index"], line["id"], line["reason"]) for line in own]
    assert [(line["index"], line["id"], line["reason"]) for line in single_skips] == named
    assert all(record_id is not None for _, record_id, _ in named)  # named as the encode's own skips are
    single_plan = np.load(plan_path(packed_prefix(single)))
    for key in ("offsets", "record_index", "length", "num_images"):
        assert np.array_equal(small_plan[key], single_plan[key]), key
    # a tampered list is caught; --overwrite recognises the size's list as neva-pack's own
    skipped_path(out, 1024).write_text("\n".join(json.dumps(line) for line in own[:1]) + "\n")
    assert main(["verify", "--quiet", str(packed_prefix(out, 1024)), "--data_path", data]) == 1
    assert "neither packed nor skipped" in capsys.readouterr().out
    assert main(preprocess_args(out, "--pack_sizes", "1024", "2048", "--overwrite")) == 0
    assert main(["verify", "--quiet", str(out), "--data_path", data]) == 0


def test_a_sizes_skipped_list_merges_the_runs_lines_and_its_own_by_record_index(tmp_path):
    run_file = skipped_path(tmp_path)
    run_file.write_text("".join(json.dumps({"index": i, "id": f"r{i}", "reason": "too_long", "detail": "x"}) + "\n" for i in (1, 7)))
    own = {"no_supervised_tokens": np.array([4, 9]), "over_image_budget": np.array([2])}
    details = size_skip_details(64, max_images_per_pack=8)
    write_size_skipped(run_file, skipped_path(tmp_path, 64), own, {2: "r2", 4: "r4", 9: None}, details)
    lines = [json.loads(line) for line in skipped_path(tmp_path, 64).read_text().splitlines()]
    assert [(line["index"], line["id"], line["reason"]) for line in lines] == [
        (1, "r1", "too_long"), (2, "r2", "over_image_budget"), (4, "r4", "no_supervised_tokens"), (7, "r7", "too_long"),
        (9, None, "no_supervised_tokens")]  # fmt: skip
    assert lines[1]["detail"] == "more images, image tokens or video tokens than --max_images_per_pack 8 allow in a pack (at pack size 64)"
    assert lines[2] == {"index": 4, "id": "r4", "reason": "no_supervised_tokens",
                        "detail": "no trained label after truncation to pack size 64"}  # fmt: skip
    assert sorted(tmp_path.iterdir()) == sorted([run_file, skipped_path(tmp_path, 64)])  # no temporary left


def test_overwrite_recognises_a_sizes_skipped_list_by_its_keys(tmp_path):
    skipped_path(tmp_path, 1024).write_text(json.dumps({"index": 3, "id": None, "reason": "no_supervised_tokens"}) + "\n")
    assert ownership.owned_outputs(tmp_path, {}) == [skipped_path(tmp_path, 1024)]
    skipped_path(tmp_path, 1024).write_text("my notes\n")
    with pytest.raises(ConfigError, match=f"{skipped_path(tmp_path, 1024).name} is not a skipped-records list"):
        ownership.owned_outputs(tmp_path, {})
