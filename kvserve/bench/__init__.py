"""`kvserve bench`: a load tester for any OpenAI-compatible server (kvserve, vLLM, llama.cpp's llama-server).

It talks to servers over HTTP only and imports nothing from `kvserve.engine` or `kvserve.model`, so it measures
what a client sees, and reads the server's own view from its Prometheus `/metrics`.

    kvserve bench --base-url http://127.0.0.1:8000 --workload shared-prefix --num-requests 1000 --max-concurrency 32
    kvserve bench compare a.json b.json
    kvserve bench suite --quick
"""
