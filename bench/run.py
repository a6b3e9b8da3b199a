"""The benchmarks from a checkout: `python bench/run.py ARGS` is `meshkd bench ARGS` (see meshkd.bench)."""

import sys

from meshkd.bench import main

if __name__ == "__main__":
    sys.exit(main())
