"""Starting an engine from command-line flags, for every front end (`kvserve serve`, `generate`, `chat`).

Each failure a user causes or can fix (a bad flag, a flag for a feature not built yet, no such model, a pool
that cannot hold --max-model-len, no GPU, out of device memory) becomes one EngineStartError whose message says
what to do: never a traceback.
"""

from __future__ import annotations

import argparse

import torch

from kvserve.config import EngineConfig, ModelLoadError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pool_sizing import PoolTooSmall
from kvserve.engine.tp_group import WorkerFailed


class EngineStartError(Exception):
    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage  # the command line itself is wrong (exit status 2)


def engine_config_from_flags(args: argparse.Namespace) -> EngineConfig:
    from kvserve.engine.args import engine_config_from_args

    try:
        return engine_config_from_args(args)
    except (NotImplementedError, ValueError, TypeError) as exc:  # NotImplementedError: a vLLM flag not built yet
        raise EngineStartError(str(exc), usage=True) from None


def start_engine(config: EngineConfig) -> LLMEngine:
    try:
        return LLMEngine(config)
    except (ModelLoadError, PoolTooSmall, WorkerFailed) as exc:
        raise EngineStartError(str(exc)) from None
    except NotImplementedError as exc:
        raise EngineStartError(str(exc), usage=True) from None
    except torch.OutOfMemoryError as exc:
        raise EngineStartError(f"out of device memory while starting the engine ({str(exc).splitlines()[0]}); "
                               "lower --gpu-memory-utilization, --max-model-len or --max-num-batched-tokens") from None
    except (ValueError, OSError) as exc:
        raise EngineStartError(f"cannot start the engine: {exc}") from None
