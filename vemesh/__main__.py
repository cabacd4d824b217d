"""``python -m vemesh``: the ``vemesh`` command line (see :mod:`vemesh.cli`)."""

from vemesh.cli import main

raise SystemExit(main())
