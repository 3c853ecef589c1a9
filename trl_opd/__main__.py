"""`python -m trl_opd ...` is `trl-opd ...` (and what `accelerate launch -m trl_opd` runs)."""

from trl_opd.tools.cli import main

main()
