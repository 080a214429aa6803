"""`python -m rtp.bench serve ...` is `rtp bench serve ...`."""

import sys

from rtp.cli import main

raise SystemExit(main(["bench", *sys.argv[1:]]))
