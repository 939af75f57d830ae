import sys

from neva_pack.cli import main

sys.exit(main())
