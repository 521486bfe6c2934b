"""``python -m kjarni``: the same command line as ``kjarni``."""

import sys

from kjarni.cli import main

sys.exit(main())
