"""``python -m monai_cache ...``: the ``monai-cache`` command line."""

import sys

from monai_cache.cli import main

if __name__ == "__main__":
    sys.exit(main())
