"""Multimodal input (images for vision-language models): what a request carries
(`inputs`), how prompts with images become token ids and encoder inputs (`processing`)."""
