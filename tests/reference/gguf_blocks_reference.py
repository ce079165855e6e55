"""Reference values for the CPU device's block-quantized linears, from the `gguf` Python package.

For each of Q8_0, Q4_0, Q4_1, Q4_K and Q6_K: two weight rows of 512 values made of seeded random
block bytes (every byte pattern is a valid block once its f16 scales are finite), the values
`gguf.quants.dequantize` gives for them, an activation row, and two dot products per weight row:
`exact`, the dequantized weights times the f32 activations, and `quantized`, the dequantized
weights times the activations quantized per block to int8 (scale max|x|/127, round half away
from zero), the arithmetic the kernels do. Both in float64.

Run outside CI:  pip install gguf numpy && python tests/reference/gguf_blocks_reference.py
"""

import importlib.metadata
import json
import pathlib

import gguf
import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / "plugins/device-cpu/src/linear/quant/reference.json"
K = 512
ROWS = 2
TYPES = {
    # name: (ggml type, block elements, block bytes, byte offsets of f16 fields, activation block)
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, 32, 34, [0], 32),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, 32, 18, [0], 32),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, 32, 20, [0, 2], 32),
    "q4_k": (gguf.GGMLQuantizationType.Q4_K, 256, 144, [0, 2], 256),
    "q6_k": (gguf.GGMLQuantizationType.Q6_K, 256, 210, [208], 256),
}


def quantize_activations(x, block):
    out = np.empty_like(x, dtype=np.float64)
    for start in range(0, len(x), block):
        values = x[start:start + block].astype(np.float32)
        d = np.float32(np.abs(values).max()) / np.float32(127.0)
        inverse = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        scaled = (values * inverse).astype(np.float64)
        q = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127)
        out[start:start + block] = np.float64(d) * q
    return out


def main():
    rng = np.random.default_rng(20261126)
    cases = {}
    for name, (qtype, elements, size, halves, act_block) in TYPES.items():
        blocks = ROWS * K // elements
        raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
        for at in halves:
            scale = rng.uniform(-0.02, 0.02, size=blocks).astype(np.float16)
            raw[:, at:at + 2] = scale.view(np.uint8).reshape(blocks, 2)
        data = raw.reshape(ROWS, K // elements * size)
        values = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(ROWS, K)
        x = rng.standard_normal(K).astype(np.float32)
        xq = quantize_activations(x, act_block)
        cases[name] = {
            "rows": [bytes(row).hex() for row in data],
            "values": [row.view(np.uint32).astype(">u4").tobytes().hex() for row in values],
            "x": x.view(np.uint32).astype(">u4").tobytes().hex(),
            "exact": [float(np.dot(row.astype(np.float64), x.astype(np.float64))) for row in values],
            "quantized": [float(np.dot(row.astype(np.float64), xq)) for row in values],
        }
    OUT.write_text(json.dumps({"gguf": importlib.metadata.version("gguf"), "inner": K, "cases": cases}) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
