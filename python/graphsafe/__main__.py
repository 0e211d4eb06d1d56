"""`python -m graphsafe ...` is the `graphsafe` command."""

from .cli import main

raise SystemExit(main())
