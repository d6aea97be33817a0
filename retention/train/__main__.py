import sys

from . import main

sys.exit(main(prog="python -m retention.train"))
