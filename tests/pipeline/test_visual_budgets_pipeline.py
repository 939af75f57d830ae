"""--max_images_per_pack / --max_image_tokens_per_pack through a run: packs within the budgets, a
sample over one skipped with its reason (every record accounted for), stats per pack, plan alike."""

import json

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.formats import open_packed
from neva_pack.files import packed_prefix, skipped_path, stats_path
from neva_pack.commands import explore, load_lengths
from tests.conftest import SAMPLE_DATA

IMAGE_POSITIONS = 49  # openai/clip-vit-base-patch32: 7 x 7 patches


def args(output_dir, *extra):
    return [
        "preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
        "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
        "--output_dir", str(output_dir), "--conv_template", "v1", "--num_workers", "0",
        "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--max_seq_length", "1024", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory):
    out = tmp_path_factory.mktemp("budgets") / "out"
    flags = ("--max_images_per_pack", "2", "--max_image_tokens_per_pack", str(IMAGE_POSITIONS), "--output_format", "compact")
    assert main(args(out, *flags)) == 0
    return out


def per_pack(table, values):
    return np.add.reduceat(values, table.offsets[:-1])


def test_every_pack_is_within_the_budgets_and_the_two_image_records_are_skipped(budgeted):
    reader = open_packed(packed_prefix(budgeted))
    table = reader.plan_table()
    assert reader.meta.max_images_per_pack == 2 and reader.meta.max_image_tokens_per_pack == IMAGE_POSITIONS
    reader.close()
    assert per_pack(table, table.num_images).max() <= 1  # one image's run fills the token budget
    assert per_pack(table, table.image_tokens).max() <= IMAGE_POSITIONS
    assert np.array_equal(table.image_tokens, table.num_images * IMAGE_POSITIONS)
    report = json.loads(stats_path(budgeted).read_text())
    records = report["records"]
    assert records["skipped_by_reason"] == {"over_image_budget": 2}  # the sample data's two 2-image records
    assert records["packed"] + records["skipped"] == records["total"] == 20
    lines = [json.loads(line) for line in skipped_path(budgeted).read_text().splitlines()]
    assert [line["reason"] for line in lines] == ["over_image_budget"] * 2
    assert "--max_image_tokens_per_pack 49" in lines[0]["detail"]
    assert main(["verify", "--quiet", str(budgeted), "--data_path", str(SAMPLE_DATA / "llava_sample.json")]) == 0


def test_stats_report_image_tokens_and_vision_cost_per_pack_against_the_budgets(budgeted, capsys):
    assert main(["stats", str(budgeted)]) == 0
    text = capsys.readouterr().out
    visual = json.loads(stats_path(budgeted).read_text())["packing"]["visual"]
    assert visual["images_per_pack"]["max"] == 1 and visual["max_images_per_pack"] == 2
    assert visual["image_tokens_per_pack"]["max"] == IMAGE_POSITIONS
    assert visual["vision_cost_per_pack"]["max"] == 49**2  # one image of 7 x 7 patches
    assert "  images       mean" in text and "budget 2 (max at 50.0%" in text
    assert f"  image tokens mean" in text and f"budget {IMAGE_POSITIONS} (max at 100.0%" in text
    assert f"  vision cost  mean" in text


def test_plan_packs_within_the_same_budgets_and_counts_the_same_skips(budgeted):
    lengths = load_lengths(budgeted)
    [row] = explore(lengths, [1024], ["first_fit_shuffle"], max_images_per_pack=2, max_image_tokens_per_pack=IMAGE_POSITIONS)
    stats = json.loads(stats_path(budgeted).read_text())["packing"]
    assert row.skipped == 2 and row.packs == stats["packs"]
    [loose] = explore(lengths, [1024], ["first_fit_shuffle"])
    assert loose.skipped == 0 and loose.packs < row.packs


def test_a_budget_changes_nothing_when_every_pack_is_within_it(tmp_path):
    assert main(args(tmp_path / "plain")) == 0
    assert main(args(tmp_path / "loose", "--max_images_per_pack", "64")) == 0
    plain, loose = (open_packed(packed_prefix(tmp_path / name)) for name in ("plain", "loose"))
    a, b = plain.plan_table(), loose.plan_table()
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.record_index, b.record_index)
    plain.close()
    loose.close()


def test_balance_reports_the_vision_encoders_overhead(tmp_path, capsys):
    assert main(args(tmp_path / "out", "--max_seq_length", "300", "--balance_data_parallel", "2")) == 0
    balance = json.loads(stats_path(tmp_path / "out").read_text())["balance"]
    assert balance["vision_overhead_after"] <= balance["vision_overhead_before"]
    assert ", vision " in capsys.readouterr().out


def test_a_plan_table_from_before_the_columns_reads_and_stats_call_the_figures_unknown():
    from neva_pack.packing import PlanTable
    from neva_pack.commands import RunReport
    from neva_pack.commands import PackingArrays, format_summary, packing_stats

    older = {"offsets": [0, 2, 3], "record_index": [0, 1, 2], "length": [100, 200, 50], "num_images": [1, 0, 2]}
    table = PlanTable.from_arrays({key: np.asarray(values) for key, values in older.items()})
    assert table.image_tokens is None and table.vision_cost is None
    assert set(table.to_arrays()) == {"offsets", "record_index", "length", "padded_length", "num_images"}
    arrays = PackingArrays(capacity=256, offsets=table.offsets, lengths=table.length, num_images=table.num_images,
                           image_positions=None, pack_images=np.array([1, 2]))  # fmt: skip
    stats = packing_stats(arrays)
    assert stats.visual.images_per_pack.max == 2 and stats.visual.image_tokens_per_pack is None
    report = RunReport(records=None, packing=stats, algorithm=None, seed=None, suggestion=None, max_seq_length=256,
                       data_prefix="p", crop_size=[336, 336], training_overrides=[])  # fmt: skip
    text = format_summary(report)
    assert "  image tokens unknown" in text and "  vision cost  unknown" in text
    assert RunReport.from_json(json.loads(json.dumps(report.to_json()))) == report
