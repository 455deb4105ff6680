"""The disk tier's file format, one block per file `<hash hex>.kvblock`:

    magic (8 B) | header length (4 B) | header JSON | payload

The header carries the layout version, the fingerprint of what wrote it (engine/tier_setup.py), the payload
length and its xxh3-64 checksum. Anything that does not parse as exactly that (another magic, a header over
MAX_HEADER_BYTES, JSON of another shape) is not a block file: read_header returns None, never raises.
"""

from __future__ import annotations

import json
import struct

import xxhash

MAGIC = b"KVSBLK01"
LAYOUT_VERSION = 3  # 2: quantized keys are stored less their layer's key offset; 3: int4 keys per channel and block
SUFFIX = ".kvblock"
TEMPORARY_SUFFIX = ".tmp"  # `<hash hex>.kvblock.tmp` while it is written, renamed when complete
MAX_HEADER_BYTES = 4096
HEADER_FIELDS = {"layout": int, "fingerprint": str, "length": int, "xxh3_64": str}


def encode_block_file(fingerprint: str, payload: bytes) -> bytes:
    header = json.dumps({"layout": LAYOUT_VERSION, "fingerprint": fingerprint, "length": len(payload),
                         "xxh3_64": xxhash.xxh3_64_hexdigest(payload)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def read_header(handle) -> dict | None:
    """The header of an open block file (the handle then at the payload), or None when it is not one."""
    if handle.read(len(MAGIC)) != MAGIC:
        return None
    raw_length = handle.read(4)
    if len(raw_length) != 4:
        return None
    (length,) = struct.unpack("<I", raw_length)
    if length > MAX_HEADER_BYTES:
        return None
    try:
        header = json.loads(handle.read(length))
    except ValueError:  # not JSON, or not UTF-8
        return None
    return header if well_formed(header) else None


def well_formed(header: object) -> bool:
    """A dict with each field of HEADER_FIELDS of its type (a bool is not a length) and a length >= 0."""
    if not isinstance(header, dict):
        return False
    for name, kind in HEADER_FIELDS.items():
        value = header.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return False
    return header["length"] >= 0


def block_hash_of(name: str) -> bytes | None:
    """The block hash a block file (or its temporary) is named after, or None for any other name."""
    stem = name.removesuffix(TEMPORARY_SUFFIX).removesuffix(SUFFIX)
    if stem == name or not stem:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None
