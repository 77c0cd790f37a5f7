"""Where the checkout is: tests run trainer.py and the benchmarks from its root."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
