"""The OpenAI-compatible HTTP server behind `kvserve serve`: FastAPI routes over the AsyncLLMEngine, vLLM-named
Prometheus metrics, OpenAI's error envelope. `build_app(async_engine, settings)` in `kvserve.server.app`."""
