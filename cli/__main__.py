"""``python -m cli``: the ``llmgw`` command without its installed script."""

import sys

from .main import main

sys.exit(main())
