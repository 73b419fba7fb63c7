"""`python -m cupysparse COMMAND`: see `cupysparse.scripts.cli`."""

import sys

from cupysparse.scripts.cli import main

if __name__ == "__main__":
    sys.exit(main())
