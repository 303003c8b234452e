"""python -m offload: see offload/cli.py."""

import sys

from .cli import main

sys.exit(main())
