"""`python -m kvstore_demo [args]`: the same as `kvstore demo [args]`."""

import sys

from .chat import main

sys.exit(main())
