"""``python -m fsd_experiments``: the ``fsd`` command line."""

from .cli import main

raise SystemExit(main())
