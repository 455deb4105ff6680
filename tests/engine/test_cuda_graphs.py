"""Decode steps through captured graphs (engine/cuda_graphs.py): which bucket a batch takes, how its padding rows
look, and, with the capture replayed eagerly on CPU over the same static buffers (CUDA's capture needs a GPU),
that padded steps give transformers' tokens while the padding rows touch no block of the pool."""

import pytest
import torch
from test_engine_parity import (MAX_NEW_TOKENS, PROMPT_LENGTHS, assert_all_blocks_free, greedy_references,
                                make_prompts)

from kvserve import LLM, SamplingParams
from kvserve.engine.cuda_graphs import DecodeBuffers, bucket_for, capture_sizes, eager_capture
from kvserve.engine.step_plan import StepInputs


def test_capture_sizes_cover_every_batch_up_to_the_cap():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(20)
    assert [bucket_for(sizes, n) for n in (1, 3, 5, 8, 9, 17, 20, 21)] == [1, 4, 8, 8, 16, 20, 20, None]


def test_padding_rows_write_nowhere_and_read_nothing():
    buffers = DecodeBuffers.allocate(8, 2, 5, torch.device("cpu"))
    inputs = StepInputs(token_ids=[11, 12, 13], positions=[40, 7, 16], slots=[[100, 200, 300], [101, 201, 301]],
                        logits_rows=[0, 1, 2], query_starts=[0, 1, 2, 3], num_computed=[40, 7, 16], num_decodes=3,
                        block_tables=[[[6, 7, 8], [9], [1, 2]], [[0, 0, 8], [9], [1, 2]]])
    buffers.fill(inputs, 4)
    assert buffers.token_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [40, 7, 16, 0]
    assert buffers.slots[:, :4].tolist() == [[100, 200, 300, -1], [101, 201, 301, -1]]
    assert buffers.context_lens[:, :4].tolist() == [[41, 8, 17, 0]] * 2
    assert buffers.block_tables[1, :4].tolist() == [[0, 0, 8, 0, 0], [9, 0, 0, 0, 0], [1, 2, 0, 0, 0], [0] * 5]
    # A smaller step afterwards leaves no row of the larger one behind in its bucket.
    buffers.fill(StepInputs([5], [3], [[50], [51]], [0], [0, 1], [3], 1, [[[4]], [[4]]]), 2)
    assert buffers.slots[:, :2].tolist() == [[50, -1], [51, -1]]
    assert buffers.context_lens[0, :2].tolist() == [4, 0]


pytest.importorskip("triton")


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(tiny_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("kind,engine_args", [
    ("llama", dict(num_gpu_blocks_override=40, max_num_batched_tokens=64)),  # preempts
    ("mistral", dict(num_gpu_blocks_override=512, disable_cascade_attn=True)),  # windows; no eager cascade steps
])
def test_padded_decode_steps_through_captured_forwards_match_transformers(kind, engine_args, references, monkeypatch):
    folder, expected = references(kind)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=512, attention_backend="triton",
              max_num_seqs=8, **engine_args)
    runner = llm.engine.runner
    assert runner.capture_decode_graphs(8, llm.engine.max_model_len, capture=eager_capture) == 4  # 1, 2, 4, 8
    filled = []  # (decodes, bucket) of each replayed step
    fill = DecodeBuffers.fill
    monkeypatch.setattr(DecodeBuffers, "fill", lambda buffers, inputs, bucket: (
        filled.append((len(inputs.token_ids), bucket)), fill(buffers, inputs, bucket)))
    # Requests ending at different lengths leave batches of 7, 6, 5 ... decodes: padded to 8, 8, 8, 4 ...
    lengths = [MAX_NEW_TOKENS - 3 * (index % 4) for index in range(len(expected))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(make_prompts(), params, use_tqdm=False)
    for index, (output, want) in enumerate(zip(outputs, expected)):
        assert output.outputs[0].token_ids == want[:lengths[index]], \
            f"prompt {index} ({PROMPT_LENGTHS[index]} tokens) diverged"
    assert runner.decode_graphs.num_replays == len(filled) > 0
    assert any(bucket > decodes for decodes, bucket in filled), f"no step was padded: {filled}"
    assert_all_blocks_free(llm)
