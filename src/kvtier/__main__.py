"""`python -m kvtier`: the `kvtier` command."""

from kvtier.cli import main

raise SystemExit(main())
