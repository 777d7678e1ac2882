"""`python -m maintainer.tiny_worlds ...`: build a tiny world's model folder (maintainer/tiny_worlds/cli.py)."""

import sys

from maintainer.tiny_worlds.cli import main

if __name__ == "__main__":
    sys.exit(main())
