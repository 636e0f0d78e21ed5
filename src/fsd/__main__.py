"""``python -m fsd``: the same as the ``fsd`` console script."""

from .cli import main

raise SystemExit(main())
