"""`python -m mmengine`: the same as the `mmengine` command."""

import sys

from mmengine.cli import main

sys.exit(main())
