"""`python -m trl_opd ...` is `trl-opd ...` (and what `accelerate launch -m trl_opd` runs)."""

from trl_opd.cli import main

main()
