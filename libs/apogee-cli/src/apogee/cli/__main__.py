"""``python -m apogee.cli``: the ``apogee`` command."""

from apogee.cli.main import main

raise SystemExit(main())
