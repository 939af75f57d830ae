#!/usr/bin/env python
"""Drop-in for NeMo's examples/multimodal/multimodal_llm/neva/sequence_packing/preprocess_dataset.py.

Same flags and defaults (plus neva_pack's own: see --help); equivalent to
``neva-pack preprocess ...``.
"""

import sys

from neva_pack.cli import main

if __name__ == "__main__":
    sys.exit(main(["preprocess", *sys.argv[1:]]))
