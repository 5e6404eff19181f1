"""`python -m jaxstitch.bench`: the benchmark table (runner.py)."""
import sys

from .runner import main

sys.exit(main())
