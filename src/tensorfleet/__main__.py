"""``python -m tensorfleet`` runs the command-line interface."""

from tensorfleet.launch.cli import main

raise SystemExit(main())
