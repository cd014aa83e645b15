"""Some layers here run their Triton kernels under the interpreter on a CPU (the DeltaNet,
the GGUF linears), which must be switched on before any kernel module is imported: here,
before this folder's test modules import the layers."""
from tllm.attention.testing import setup_triton_for_tests

setup_triton_for_tests()
