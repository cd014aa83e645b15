"""The sliding-window tests run the Triton backend interpreted on a CPU: the interpreter must
be on before any kernel module is imported, which a test module's own imports would do first
when it runs alone."""
from tllm.attention.testing import setup_triton_for_tests

setup_triton_for_tests()
