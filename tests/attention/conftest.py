"""Triton kernels run on the GPU when there is one, else on the CPU under the Triton
interpreter, which must be switched on before any kernel module is imported: here."""
import pytest

from tllm.attention.testing import setup_triton_for_tests

DEVICE = setup_triton_for_tests()


@pytest.fixture
def device():
    return DEVICE
