"""`kvserve generate` and `kvserve chat` as a user runs them: the engine's text on stdout, and start-up failures
(bad flags, no such model, no GPU) as one line on stderr with exit status 2 (usage) or 1, never a traceback."""

import io

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli import main

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "64"]


def tiny_llm(folder) -> LLM:
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_generate_prints_the_engine_text(tiny_model_dir, capsys):
    folder, _ = tiny_model_dir("llama")
    assert main(["generate", "--model", str(folder), *ENGINE_FLAGS, "--max-tokens", "6", "--ignore-eos",
                 "hello there"]) == 0
    out = capsys.readouterr()
    assert out.out == tiny_llm(folder).generate(["hello there"], GREEDY, use_tqdm=False)[0].outputs[0].text + "\n"
    assert "tok/s" in out.err


def test_chat_answers_each_line_until_an_empty_one(tiny_model_dir, capsys, monkeypatch):
    folder, _ = tiny_model_dir("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nand again\n\nnot read\n"))
    assert main(["chat", "--model", str(folder), *ENGINE_FLAGS, "--max-tokens", "6", "--ignore-eos"]) == 0
    llm, messages, transcript = tiny_llm(folder), [], ""
    for user in ["hi", "and again"]:  # the same conversation through the offline API, turn by turn
        messages.append({"role": "user", "content": user})
        reply = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        transcript += f"> {reply}\n"
    assert capsys.readouterr().out == transcript + "> "  # the empty line ended the session


@pytest.mark.parametrize("argv,status,message", [
    (["--temperature", "-1"], 2, "temperature must be non-negative"),
    (["--tensor-parallel-size", "2"], 1, "--tensor-parallel-size 2 does not divide"),
    (["--model", "/no/such/model"], 1, "/no/such/model: no such file or folder"),
    (["--device", "tpu"], 1, "--device must be auto, cpu, cuda or cuda:N"),
])
def test_start_up_failures_are_one_line(argv, status, message, capsys):
    assert main(["generate", *argv, "hi"]) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve generate: error:") and message in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve", "--port", "0"]])
def test_asking_for_cuda_without_a_gpu_says_so(command, capsys):
    assert main([*command, "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip()
    assert "torch sees no CUDA device" in err and "\n" not in err
