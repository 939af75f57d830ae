"""`neva-pack preprocess` never imports megatron-core, nor transformers.

Its import costs about 4 s of CPU: on a small machine that is taken from the encoding workers,
or spent before the first pack is written. Preprocessing writes and reads the IndexedDataset
format with files/indexed.py; only what reads an output for training (and verify) uses
Megatron's reader.
"""

import json
import subprocess
import sys

from neva_pack.files import bin_path, packed_prefix
from tests.conftest import ROOT, SAMPLE_DATA

RUNS = """
import json, sys
from neva_pack.cli import main
codes = [main(["preprocess", "--quiet", *args]) for args in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "megatron": sorted(m for m in sys.modules if m.startswith("megatron")),
                  "transformers": "transformers" in sys.modules}))
"""


def test_preprocess_never_imports_megatron(tmp_path):
    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    text = tmp_path / "text.json"
    for record in records:
        record.pop("image", None)
        for turn in record["conversations"]:
            turn["value"] = turn["value"].replace("<image>\n", "").replace("<image>", "")
    text.write_text(json.dumps(records))
    common = ["--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"), "--conv_template", "v1",
              "--max_seq_length", "2048", "--num_workers", "0"]  # fmt: skip
    image = ["--data_path", str(SAMPLE_DATA / "llava_sample.json"), "--image_folder", str(SAMPLE_DATA / "images"),
             "--image_aspect_ratio", "pad", *common]  # fmt: skip
    runs = [
        ["--data_path", str(text), "--output_dir", str(tmp_path / "text_nemo"), *common],
        ["--data_path", str(text), "--output_dir", str(tmp_path / "text_compact"), "--output_format", "compact", *common],
        [*image, "--output_dir", str(tmp_path / "image_nemo")],
        [*image, "--output_dir", str(tmp_path / "image_compact"), "--output_format", "compact"],
        *([*image, "--output_dir", str(tmp_path / "sharded"), "--num_shards", "2", "--shard_index", str(i)] for i in (0, 1)),
        [*image, "--output_dir", str(tmp_path / "sharded"), "--num_shards", "2"],  # the final step: join, pack, write
    ]
    done = subprocess.run([sys.executable, "-c", RUNS, json.dumps(runs)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0] * len(runs)
    assert result["megatron"] == []
    assert result["transformers"] is False  # the fast image paths need no processor (seconds, hundreds of MB a process)
    assert bin_path(packed_prefix(tmp_path / "sharded")).read_bytes() == bin_path(packed_prefix(tmp_path / "image_nemo")).read_bytes()
