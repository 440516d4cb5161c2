"""GGUF tensor payloads -> numpy floats, or exactly into MLX affine quantization.

GGUF's legacy block formats are affine per block of 32 weights, which is what MLX's `affine`
quantization is with group size 32:

  Q4_0  block = d:f16, 16 bytes of nibbles      w = d * (q - 8)    -> scale d, bias -8d, 4 bits
  Q4_1  block = d:f16, m:f16, 16 bytes nibbles  w = d * q + m      -> scale d, bias m,   4 bits
  Q8_0  block = d:f16, 32 x int8                w = d * q          -> q + 128, bias -128d, 8 bits

Inside a Q4 block, byte j holds element j (low nibble) and element j + 16 (high nibble); MLX
packs element i of a group into bits 4i.. of little-endian uint32 words. A 4-bit block also
fits an 8-bit MLX group exactly (same scale and bias, q in 0..15), which is how `--quantize 8`
keeps a Q4 tensor lossless. Everything else is dequantized with the `gguf` package's reference
code (K-quants, Q5_*) and, where asked, re-quantized by MLX.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as _gguf_dequantize

FLOAT_TYPES = {QT.F32, QT.F16, QT.BF16}
EXACT_AFFINE = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q8_0: 8}  # source bits of the formats MLX holds exactly
DEQUANTIZED = {QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
SUPPORTED = FLOAT_TYPES | set(EXACT_AFFINE) | DEQUANTIZED
GROUP = 32  # block size of Q4_0 / Q4_1 / Q8_0


def supported_names() -> str:
    return ", ".join(sorted(t.name for t in SUPPORTED))


def to_float32(data: np.ndarray, qtype: QT) -> np.ndarray:
    """A tensor's payload (as GGUFReader maps it) as float32 [rows, cols]."""
    if qtype == QT.F32:
        return np.asarray(data, dtype=np.float32)
    if qtype == QT.F16:
        return np.asarray(data).view(np.float16).astype(np.float32)
    return _gguf_dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)


def _blocks(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """uint8 [rows, nbytes] -> [rows, nblocks, bytes_per_block]."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(raw).view(np.uint8)
    rows = raw.shape[0] if raw.ndim > 1 else 1
    return raw.reshape(rows, -1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _unpack_q4(qs: np.ndarray) -> np.ndarray:
    """[rows, nblocks, 16] nibble bytes -> [rows, nblocks, 32] values 0..15 in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def affine_parts(raw: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_0 / Q4_1 / Q8_0 payload -> (q uint8 [rows, cols], scale f32, bias f32 [rows, cols/32], bits).

    q is unsigned: w = scale * q + bias exactly (the same float32 arithmetic as llama.cpp's)."""
    b = _blocks(raw, qtype)
    rows, nb = b.shape[:2]
    d = _f16(b[..., 0:2])
    if qtype == QT.Q4_0:
        q, bias = _unpack_q4(b[..., 2:18]), -8.0 * d
    elif qtype == QT.Q4_1:
        q, bias = _unpack_q4(b[..., 4:20]), _f16(b[..., 2:4])
    elif qtype == QT.Q8_0:
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = -128.0 * d
    else:
        raise ValueError(f"{qtype.name} is not an MLX-exact format")
    return q.reshape(rows, nb * GROUP), d, bias.astype(np.float32), EXACT_AFFINE[qtype]


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [rows, cols] (< 2**bits) -> MLX's packed uint32 [rows, cols * bits / 32]."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32).reshape(rows, cols // 4)
    if bits == 4:
        pairs = q.reshape(rows, cols // 2, 2).astype(np.uint8)
        byte = pairs[..., 0] | (pairs[..., 1] << 4)
        return np.ascontiguousarray(byte).view(np.uint32).reshape(rows, cols // 8)
    raise ValueError(f"cannot pack {bits}-bit values")


def exact_affine(raw: np.ndarray, qtype: QT, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """MLX affine (weight uint32, scales, biases) with group size 32 holding exactly the GGUF
    values at `bits` bits, or None where that is not exact (Q8_0 into 4 bits)."""
    q, scale, bias, src_bits = affine_parts(raw, qtype)
    if src_bits > bits:
        return None
    return pack(q, bits), scale, bias


def permute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    llama.cpp stores each head's rows as [pairs(2) x half] -> [half x 2] interleaved, so that
    its "normal" RoPE (adjacent pairs) sees what HF's rotate-half RoPE sees. Rows carry whole
    blocks (quantization runs along the input dimension), so the same row order applies to
    packed weights, scales and biases alike."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    half = rows // n_head // 2
    return a.reshape(n_head, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
