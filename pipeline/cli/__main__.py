"""``python -m pipeline.cli``: the same as the ``runnel`` command."""
import sys

from pipeline.cli.main import main

sys.exit(main())
