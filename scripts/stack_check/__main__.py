"""`python -m scripts.stack_check` (`make stack-check`)."""

import sys

from scripts.stack_check.main import main

sys.exit(main())
