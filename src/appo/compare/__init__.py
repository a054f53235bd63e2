"""`appo compare`: methods compared at an equal budget over seeds (issue 23).

`spec` reads and checks the spec file (the equal-budget rule), `runner` trains and evaluates
the missing (variant, seed) pairs as ordinary runs, `stats` holds the intervals (t over
seeds, paired bootstrap over questions and seeds) and `report` writes Markdown and plots
from whatever has finished.
"""
