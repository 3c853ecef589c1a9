"""The command-line tools around the library: `trl-opd` (`cli.py`) and what its subcommands run (recipes, the
pre-flight check, the teacher server, the comparison), and the test infrastructure (`testing.py`)."""
