"""`python -m scripts.ui_check` (`make ui-check`)."""

import sys

from scripts.ui_check.main import main

sys.exit(main())
