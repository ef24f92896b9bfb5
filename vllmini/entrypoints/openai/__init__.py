"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (``vllmini serve``), with vLLM's
routes and request fields: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``, ``/version``, ``/metrics``, LoRA
loading, and with the pooling runner ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``
and ``/rerank``, SageMaker's ``/ping`` and ``/invocations`` (api_server.build_app lists them)."""

# the server's limit on a request's body (api_server.LimitRequestBody; `--max-request-body-size`), here
# so that the CLI reads it without importing the server. (vLLM's Python server has no limit; its Rust
# front end refuses bodies over 32 MiB.)
DEFAULT_MAX_REQUEST_BODY_SIZE = 32 << 20
