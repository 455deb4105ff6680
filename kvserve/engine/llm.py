"""The offline API: `LLM(model=..., **engine_args).generate(prompts, params)`, shaped like vLLM's."""

from __future__ import annotations

import itertools
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import Tokenizer

Prompt = str | list[int] | dict[str, Any]  # dict: vLLM's TextPrompt {"prompt": ...} or TokensPrompt {"prompt_token_ids": ...}


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._start(LLMEngine.from_engine_args(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls.from_engine(LLMEngine(config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(engine)
        return llm

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(prompt) for prompt in prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        request_ids = [str(next(self._ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, param in zip(request_ids, prompts, params):
                self.engine.add_request(request_id, prompt, param)
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)  # one bad prompt rejects the call, not the prompts before it
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            # The template already wrote any BOS the model wants.
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)

    def close(self) -> None:
        """Saves the disk tier's blocks (--kv-disk-path) and stops its writer; the engine is unusable after."""
        self.engine.close()

    def reset_prefix_cache(self) -> bool:
        return self.engine.kv_cache.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine stopped with requests unfinished: {sorted(pending)}")
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids in a prompt given as either, or as vLLM's TextPrompt / TokensPrompt dict."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids'; got keys {sorted(prompt)}")
