"""`python -m meshkd` is the `meshkd` command."""

from meshkd.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
