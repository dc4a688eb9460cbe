"""``python -m tierckpt.cli``."""

import sys

from tierckpt.cli import main

sys.exit(main())
