"""`python -m tuneforge`: the `tuneforge` command (tuneforge.cli), for environments whose scripts folder is not on
PATH."""

import sys

from tuneforge.cli import main

sys.exit(main())
