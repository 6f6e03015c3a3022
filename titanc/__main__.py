"""`python -m titanc ...`: the same as the `titanc` command."""

from titanc.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
