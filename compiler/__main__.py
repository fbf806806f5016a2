"""`python -m tilertc`: the `tilertc` command, for a Python whose scripts are not on PATH (the
lent GPU machine's `python3`, where `pip install` writes the script for another Python)."""

from tilertc.cli import main

main(prog_name="tilertc")
