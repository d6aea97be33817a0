"""Train retention gates: ``accelerate launch train.py --config configs/<name>.yaml`` (or plain python)."""

import sys

from retention.train import main

if __name__ == "__main__":
    sys.exit(main())
