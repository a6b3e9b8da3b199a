"""`python -m meshkd` is the `meshkd` command, and the entry point of its worker processes."""

import os
import warnings

# A worker other than global rank 0 shows no progress bars, library notices or warnings (every rank would
# print the same), only its errors. Set before torch and transformers are imported: tqdm (imported by
# torch) and transformers read these once, at import.
if os.environ.get("RANK", "0") != "0":
    os.environ.update(TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    warnings.simplefilter("ignore")

from meshkd.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
