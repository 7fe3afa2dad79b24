"""``python -m orbax_flax``: see :mod:`orbax_flax.cli`."""

import sys

from orbax_flax import cli

if __name__ == "__main__":
  sys.exit(cli.main())
