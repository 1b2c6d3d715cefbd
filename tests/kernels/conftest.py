"""`emulator`: each kernel source's CPU harness in turn, the Metal kernel (harness.Emulator) and its CUDA twin
(cuda_harness.CudaEmulator), for the tests that hold both sources to the same oracle."""

from tests.msl.cuda_harness import CudaEmulator
from tests.msl.harness import Emulator

import pytest


@pytest.fixture(params=[Emulator, CudaEmulator], ids=["metal", "cuda"])
def emulator(request):
    """The launcher class: `emulator(strict=..., seed=...)` makes one."""
    return request.param
