"""`python -m tandem.cli ...`: the `tandem` command."""

from tandem.cli.main import main

raise SystemExit(main())
