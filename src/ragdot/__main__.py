"""``python -m ragdot`` runs the ``ragdot`` command (see ragdot.cli)."""

import sys

from ragdot.cli import main

if __name__ == "__main__":
  sys.exit(main())
