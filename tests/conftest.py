import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def run_example():
    """Run ``examples/<script>`` with `args` as a user would (a subprocess from the repository
    root); returns its stdout, failing the test with the stderr tail if it exits non-zero."""
    import subprocess

    def run(script: str, *args: str) -> str:
        proc = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    return run
