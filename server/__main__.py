"""`python -m server`: the same as `minivllm-serve`."""

import sys

from server.cli import main

sys.exit(main())
