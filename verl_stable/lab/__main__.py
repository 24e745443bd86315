"""``python -m verl_stable.lab``: same as ``verl-stable lab``."""

from verl_stable.lab.cli import main

raise SystemExit(main())
