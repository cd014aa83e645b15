"""The OpenAI protocol: request and response models, completions, chat, responses, tool calls and reasoning parsers, sampling parameters from a request."""
