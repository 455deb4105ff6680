"""`kvserve serve` as an operator runs it: vLLM's command line, --config files, clean start-up failures, and a
SIGTERM that drains running requests and exits 0 (a real subprocess)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from ports import free_port

from kvserve.cli import build_parser, main
from kvserve.server.config_file import ConfigFileError, apply_config_file

SEED_COMMAND = ("serve --model Qwen/Qwen2.5-14B-Instruct --gpu-memory-utilization 0.9 --max-model-len 32768 "
                "--max-num-seqs 64 --enable-prefix-caching --tensor-parallel-size 1 --kv-cache-dtype fp8 "
                "--dtype bfloat16").split()


def parse(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        apply_config_file(args._serve_parser, args, args.config)
    return args


def test_the_seed_command_line_parses():
    args = parse(SEED_COMMAND)
    assert (args.model, args.gpu_memory_utilization, args.max_model_len, args.max_num_seqs) == \
           ("Qwen/Qwen2.5-14B-Instruct", 0.9, 32768, 64)
    assert args.enable_prefix_caching and args.tensor_parallel_size == 1
    assert (args.kv_cache_dtype, args.dtype) == ("fp8", "bfloat16")


@pytest.mark.parametrize("tensor_parallel_size", ["1", "2"])
def test_hub_id_fails_cleanly(tensor_parallel_size, capsys):
    """The seed's command line (fp8 KV and TP included) gets as far as loading the model, which is not on disk
    here: one line, before any tensor-parallel worker starts."""
    argv = [a if a != "1" else tensor_parallel_size for a in SEED_COMMAND] + ["--port", "0"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve serve: error: Qwen/Qwen2.5-14B-Instruct: no such file or folder")
    assert "Traceback" not in err and "\n" not in err


def test_busy_port_fails_cleanly(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_config_file_keys_and_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 1234\nmax-model-len: 512\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\napi-key: k\ndisable-log-stats: true\nkv-cache-dtype: float16\n"
    )
    args = parse(["serve", "--port", "9000", "--config", str(config), "--kv-cache-dtype", "auto"])
    assert args.port == 9000 and args.kv_cache_dtype == "auto"  # given on the command line
    assert (args.max_model_len, args.max_num_seqs, args.enable_prefix_caching) == (512, 8, False)
    assert args.served_model_name == ["a", "b"] and args.api_key == "k" and args.disable_log_stats
    # An explicit flag equal to the default still beats the file.
    assert parse(["serve", "--enable-prefix-caching", "--config", str(config)]).enable_prefix_caching


@pytest.mark.parametrize("content,message", [
    ("max-modle-len: 512\n", "unknown option 'max-modle-len'"),
    ("kv-cache-dtype: fp4\n", "invalid value"),
    ("- just\n- a list\n", "expected a mapping"),
    ("enable-prefix-caching: maybe\n", "must be true or false"),
    ("port: [\n", "not valid YAML"),
])
def test_bad_config_file(tmp_path, content, message):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    with pytest.raises(ConfigFileError, match=message.replace("[", r"\[")):
        parse(["serve", "--config", str(config)])


def test_bad_config_file_exits_2(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("no-such-flag: 1\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "no-such-flag" in capsys.readouterr().err



def test_sigterm_drains_running_requests_and_exits_0(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {folder}\ndtype: float32\ndevice: cpu\nmax-model-len: 1024\n"
                      "num-gpu-blocks-override: 64\nshutdown-timeout: 30\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
         "--port", str(port), "--disable-log-stats"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)

        events: list[str] = []
        first_event = threading.Event()

        def stream():
            # About 1 ms a token here: long enough that most of it streams after the SIGTERM.
            body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        first_event.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_event.wait(30)
        process.send_signal(signal.SIGTERM)
        num_events_at_signal = len(events)
        reader.join(timeout=60)
        assert process.wait(timeout=60) == 0
        output = process.stdout.read()
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length"  # ran to completion during the drain
        assert len(events) > num_events_at_signal + 10
        assert "received SIGTERM" in output and "Traceback" not in output
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
