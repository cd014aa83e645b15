"""The verify-graph tests run the Triton kernels (interpreted on the CPU), whose interpreter
must be switched on before any kernel module is imported: here, before the test modules."""
from tllm.attention.testing import setup_triton_for_tests

setup_triton_for_tests()
