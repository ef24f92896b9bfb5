"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the token ids the engine would take for a
prompt (or a chat through the template), and the text of token ids, without generating."""
from __future__ import annotations

from typing import Any

from vllmini.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat
from vllmini.entrypoints.openai.serving_engine import off_loop


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # (its chat template and request checks, and the model's tokenizer)
        self.vocab_size = chat.engine.engine.vocab_size

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(request.model)
        request.check()
        return await off_loop(self._tokenize, request)  # (a long prompt: seconds, which held every stream)

    def _tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        if request.messages is not None:
            rendered = self.chat.render(request)
            ids = rendered["prompt_token_ids"]
            if request.add_special_tokens:  # (as vLLM: False unless asked, the template wrote them)
                ids = self.chat.tokenizer(rendered["prompt"], add_special_tokens=True).input_ids
        else:
            special = request.add_special_tokens is not False
            ids = self.chat.tokenizer(request.prompt, add_special_tokens=special).input_ids
        strs = self.chat.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.chat.max_model_len, "tokens": list(ids), "token_strs": strs}

    async def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(request.model)
        if bad := [t for t in request.tokens if not 0 <= t < self.vocab_size]:
            raise ValueError(f"tokens: {bad[:5]} are not token ids of this model (vocabulary size {self.vocab_size})")
        return {"prompt": self.chat.tokenizer.decode(request.tokens)}
