"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (``vllmini serve``), with vLLM's
routes and request fields: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``."""
