"""``python -m srtrain.data prepare|merge``."""

import sys

from srtrain.data.cli import main

sys.exit(main())
