"""Each family's docs page has an "Offline, with a stand-in tokenizer" block: the commands a user without
the checkpoint runs from the repository root on sample_data/. They are run here as written (only /tmp/
moved into the test's own directory), so a page cannot promise a command that fails."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from neva_pack.formats import open_packed

ROOT = Path(__file__).resolve().parent.parent.parent
PAGES = ("docs/qwen3_vl.md", "docs/gemma4.md", "docs/internvl.md", "docs/dynamic_resolution.md")
SECTION = "## Offline, with a stand-in tokenizer"


def offline_block(page: str) -> str:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert SECTION in text, f"{page} has no offline example"
    section = text[text.index(SECTION):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_offline_example_runs_as_written(page, tmp_path):
    block = offline_block(page).replace("/tmp/stand_in", str(tmp_path))
    bin_dir = Path(sys.executable).parent
    script = f'set -euo pipefail\nexport PATH="{bin_dir}:$PATH"\nalias python="{sys.executable}"\n' + block
    result = subprocess.run(["bash", "-c", script.replace("python scripts/", f"{sys.executable} scripts/")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    outputs = sorted(tmp_path.glob("out_*"))
    assert outputs and len(outputs) == block.count("--output_dir")
    for output in outputs:
        packed = open_packed(output)
        assert len(packed) > 0


def test_every_offline_block_uses_the_stand_in_and_sample_data():
    """The blocks stay runnable offline: no checkpoint path, only the bundled data."""
    for page in PAGES:
        block = offline_block(page)
        assert "checkpoints/" not in block and "scripts/stand_in_tokenizer.py" in block
        assert block.count("--data_path sample_data/llava_sample.json") == block.count("neva-pack preprocess")
