"""`python -m convert` is `minivllm-convert`."""

from convert.cli import main

raise SystemExit(main())
