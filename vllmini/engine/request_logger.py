"""vLLM's ``enable_log_requests``: one INFO line per request the async engine accepts (its prompt,
token ids and parameters, each cut to ``max_log_len``) and per abort, for following a server's
traffic. Off by default, as in vLLM: prompts may hold what users would not want in a log."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllmini")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len  # characters of a prompt and ids of its token ids (None: all)

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any,
                   lora_request: Any = None) -> None:  # fmt: skip
        cut = self.max_log_len
        if cut is not None:
            prompt = None if prompt is None else prompt[:cut]
            prompt_token_ids = prompt_token_ids[:cut]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s",
                    request_id, prompt, params, prompt_token_ids, lora_request)  # fmt: skip

    def log_aborts(self, request_ids: list[str]) -> None:
        logger.info("Aborted request(s) %s.", ", ".join(request_ids))
