"""LoRA tests: Triton kernels on the GPU when there is one, else under the interpreter
(switched on before any kernel module is imported: here)."""
import pytest

from tllm.attention.testing import setup_triton_for_tests

DEVICE = setup_triton_for_tests()


@pytest.fixture
def device():
    return DEVICE
