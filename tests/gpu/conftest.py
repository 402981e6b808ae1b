"""The CUDA tier: ``tests/gpu/gpu_*.py``, run by ``bench/gpu_check.sh`` on a GPU machine.

The files are named ``gpu_*.py``, not ``test_*.py``, so the default ``pytest`` run (CI, no
GPU) does not collect them; they run only when named explicitly.  Without CUDA every test
here FAILS (it is never skipped): a GPU check that ran nothing must not look green.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)
        item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("CUDA is not available: the GPU tier must run on a GPU machine")
