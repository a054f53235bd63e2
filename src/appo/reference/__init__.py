"""References generated from the code: every config key (`config_doc`, from the schema, its
comments, the range table and the verl key rules) and the command line (`cli_doc`, from the
argparse parser). `docs/reference/*.md` are their output, kept in sync by
`tests/test_reference.py`; `appo reference --out docs/reference` rewrites them and
`appo config explain KEY` prints one entry.
"""
