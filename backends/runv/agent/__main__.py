"""``python -m backends.runv.agent``: the guest agent's entry point."""

import sys

from backends.runv.agent.server import main

sys.exit(main())
