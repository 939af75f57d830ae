"""Every format's publish survives a SIGKILL at any step: a run killed while it publishes leaves no
published prefix that is not whole, and ``--resume`` then gives, file for file and byte for byte,
what an uninterrupted run gives, with no temporary left behind.

The kill lands before the n-th file-system call of the writer's ``publish`` (``tests/publish_faults.py``):
the points are spread over each format's publish, between a file written and its rename, between
two renames, and between the last rename and the meta.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from neva_pack.cli import main
from neva_pack.files import paths
from neva_pack.formats import read_meta_json
from tests.conftest import SAMPLE_DATA
from tests.publish_faults import killed_in_publish

RECORDS = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
TEXT_ONLY = ("bridge", "bridge_parquet")
BOUNDARIES = {"replace", "rename", "unlink", "remove", "mkdir", "rmdir", "fsync", "commit"}
POINTS_PER_FORMAT = 4


def command(fmt: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "preprocess", "--data_path", str(data), "--image_folder", str(SAMPLE_DATA / "images"),
        "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--output_dir", str(out), "--conv_template", "v1",
        "--max_seq_length", "1024", "--output_format", fmt, "--seed", "3", "--checkpoint_every", "10", "--num_workers", "0", "--quiet", *extra,
    ]  # fmt: skip


def tree(out: Path) -> dict[str, bytes]:
    """Every file under the output directory by relative name; the stats (which hold the run's
    timing) by name only, and the meta without its checksums of them."""
    files = {}
    for path in sorted(out.rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(out))
        if path.name.startswith(paths.STATS_FILE.split(".")[0]) and path.suffix == ".json":
            files[name] = b"(stats)"
        elif path.name.endswith(paths.META_SUFFIX):
            meta = read_meta_json(path)
            checksums = meta["checksums"]["files"]
            meta["checksums"]["files"] = {k: v for k, v in checksums.items() if not Path(k).name.startswith("stats")}
            meta.pop("meta_checksum")
            files[name] = json.dumps(meta, sort_keys=True).encode()
        else:
            files[name] = path.read_bytes()
    return files


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    mixed, text = root / "mixed.json", root / "text.json"
    mixed.write_text(json.dumps(RECORDS * 3))  # over 32 packs: the writer checkpoints before it publishes
    text.write_text(json.dumps([r for r in RECORDS if "image" not in r] * 150))
    return {"mixed": mixed, "text": text}


_REFERENCES: dict[str, tuple[dict[str, bytes], list[str]]] = {}


def reference(fmt: str, inputs, root: Path) -> tuple[Path, dict[str, bytes], list[str]]:
    """The format's uninterrupted run (its files) and the names of its publish's steps."""
    data = inputs["text" if fmt in TEXT_ONLY else "mixed"]
    if fmt not in _REFERENCES:
        out, steps = root / f"reference_{fmt}", root / f"steps_{fmt}.json"
        done = killed_in_publish(command(fmt, data, out), 0, steps)
        assert done.returncode == 0, done.stderr
        _REFERENCES[fmt] = (tree(out), json.loads(steps.read_text()))
    return data, *_REFERENCES[fmt]


def kill_points(steps: list[str]) -> list[int]:
    """Steps (1-based) to be killed before: before and after every rename (the publish's commit
    points), the last step, and up to POINTS_PER_FORMAT more spread over the other boundaries
    (removals, directories made, fsyncs, sqlite commits)."""
    renames = {k + shift for k, name in enumerate(steps, start=1) if name in ("replace", "rename") for shift in (0, 1)}
    others = sorted({k + shift for k, name in enumerate(steps, start=1) if name in BOUNDARIES for shift in (0, 1)} - renames)
    spread = others[:: max(1, len(others) // POINTS_PER_FORMAT)][:POINTS_PER_FORMAT]
    return sorted(k for k in renames | set(spread) | {len(steps)} if 1 <= k <= len(steps))


def after(steps: list[str], name: str, nth: int = 0) -> int:
    """The step right after the ``nth`` step called ``name`` (negative: from the end)."""
    return [k for k, step in enumerate(steps, start=1) if step == name][nth] + 1


def killed_then_resumed(fmt: str, inputs, root: Path, tmp_path: Path, choose=kill_points) -> None:
    data, expected, steps = reference(fmt, inputs, root)
    for point in choose(steps):
        out = tmp_path / f"out_{point}"
        killed = killed_in_publish(command(fmt, data, out), point)
        assert killed.returncode == -signal.SIGKILL, (point, steps[point - 1], killed.stderr[-2000:])
        if paths.meta_path(paths.packed_prefix(out)).exists():  # published: whole (a lock, a temporary may be left)
            left = tree(out)
            assert {name: left.get(name) for name in expected} == expected, f"killed at step {point}: a partial publish"
        assert main(command(fmt, data, out, "--resume")) == 0, (point, steps[point - 1])
        assert tree(out) == expected, f"killed at step {point} of {len(steps)} ({steps[point - 1]}): resumed output differs"


@pytest.fixture(scope="module")
def reference_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("references")


def test_energon_killed_while_it_writes_its_index_or_between_renames_resumes_to_the_same_bytes(
    inputs, reference_root, tmp_path
):  # fmt: skip
    """Killed after .nv-meta/ was begun (the resumed writer writes it again, whole), and after the
    dataset and the plan table were renamed into place but before the meta."""
    killed_then_resumed("energon", inputs, reference_root, tmp_path,
                        lambda steps: [after(steps, "mkdir"), after(steps, "replace", -2)])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nemo", "compact", "bridge", "bridge_parquet", "energon", "llamafactory"])
def test_every_format_killed_at_steps_of_its_publish_resumes_to_the_same_bytes(inputs, reference_root, tmp_path, fmt):
    killed_then_resumed(fmt, inputs, reference_root, tmp_path)


@pytest.mark.slow
def test_a_resume_killed_in_its_turn_before_it_publishes_resumes_to_the_same_bytes(inputs, reference_root, tmp_path):
    """Killed with the .bin renamed into place and not its index; the resume killed too, before its
    own publish wrote anything: the .bin stays recognisably the run's, and the next resume finishes."""
    data, expected, steps = reference("nemo", inputs, reference_root)
    out = tmp_path / "out"
    assert killed_in_publish(command("nemo", data, out), after(steps, "replace", 1)).returncode == -signal.SIGKILL
    assert killed_in_publish(command("nemo", data, out, "--resume"), 1).returncode == -signal.SIGKILL
    assert main(command("nemo", data, out, "--resume")) == 0
    assert tree(out) == expected
