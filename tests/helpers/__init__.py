"""What the tests share: starting ranks (ranks, forkserver), comparing runs (compare), the models and
optimizers they train (tiny_gpt, tp_model, optimizers) and other DeepSpeed releases' venvs (venvs)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "workers")  # the scripts a test runs as ranks
