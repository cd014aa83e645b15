from tllm.models.registry import get_model_class, register_model, supported_architectures

__all__ = ["get_model_class", "register_model", "supported_architectures"]
