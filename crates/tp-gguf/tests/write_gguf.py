"""Writes GGUF files with the `gguf` Python package's writer (llama.cpp's own), for tp-gguf's tests.

Usage: python3 write_gguf.py OUT_DIR

Writes into OUT_DIR:
  values.gguf      metadata of every value type (extremes, special floats, empty and non-ASCII
                   strings, arrays of every element type, nested arrays) and tensors of several
                   types: F32, F16, BF16, I8, I32, F64, Q8_0 and Q4_0 (from gguf.quants.quantize),
                   Q6_K and Q4_K given as raw bytes (raw_dtype), 1 to 4 dimensions
  aligned.gguf     general.alignment = 64 and tensors of odd sizes, so padding matters
  no_tensors.gguf  metadata only
  bigendian.gguf   a big-endian file (the writer's endianess=BIG)
  small.gguf       the file tests/common/builder.rs rebuilds byte for byte
  t_*.bin          each tensor's bytes as handed to the writer
  manifest.json    for each file: every metadata pair (type and value, floats as bit patterns),
                   every tensor (name, type number, dims in ggml order, bytes file), and where the
                   package's own reader (GGUFReader) found the data section and each tensor
  types.json       the package's table of ggml types: number -> [name, block elements, block bytes]
"""

import json
import struct
import sys
from pathlib import Path

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as T
except ImportError as e:  # the test names the fix
    print(f"cannot import the gguf Python package ({e}): pip install gguf==0.19.0", file=sys.stderr)
    sys.exit(3)

NAMES = {
    T.UINT8: "u8", T.INT8: "i8", T.UINT16: "u16", T.INT16: "i16", T.UINT32: "u32", T.INT32: "i32",
    T.FLOAT32: "f32", T.BOOL: "bool", T.STRING: "str", T.ARRAY: "arr", T.UINT64: "u64",
    T.INT64: "i64", T.FLOAT64: "f64",
}


def encode(value, vtype, sub_type=None):
    """The expected value as JSON; the element type of an inner array is the one the writer infers."""
    if vtype == T.ARRAY:
        elem = sub_type if sub_type is not None else T.get_type(value[0])
        return {"t": "arr", "e": NAMES[elem], "v": [encode(v, elem) for v in value]}
    if vtype == T.FLOAT32:
        return {"t": "f32", "bits": struct.unpack("<I", struct.pack("<f", value))[0]}
    if vtype == T.FLOAT64:
        return {"t": "f64", "bits": struct.unpack("<Q", struct.pack("<d", value))[0]}
    return {"t": NAMES[vtype], "v": value}


INF, NAN = float("inf"), float("nan")

# (key, value, type, element type of an outer array)
METADATA = [
    ("t.u8", 255, T.UINT8, None),
    ("t.i8", -128, T.INT8, None),
    ("t.u16", 65535, T.UINT16, None),
    ("t.i16", -32768, T.INT16, None),
    ("t.u32", 4294967295, T.UINT32, None),
    ("t.i32", -2147483648, T.INT32, None),
    ("t.u64", 18446744073709551615, T.UINT64, None),
    ("t.i64", -9223372036854775808, T.INT64, None),
    ("t.f32", 0.1, T.FLOAT32, None),
    ("t.f32_neg_zero", -0.0, T.FLOAT32, None),
    ("t.f32_inf", -INF, T.FLOAT32, None),
    ("t.f32_nan", NAN, T.FLOAT32, None),
    ("t.f32_subnormal", 1e-45, T.FLOAT32, None),
    ("t.f64", 2.0 / 3.0, T.FLOAT64, None),
    ("t.f64_inf", INF, T.FLOAT64, None),
    ("t.true", True, T.BOOL, None),
    ("t.false", False, T.BOOL, None),
    ("t.str", "héllo, 世界 \U0001F600\n\t\"quoted\"", T.STRING, None),
    ("t.empty_str", "", T.STRING, None),
    ("a.u8", [0, 1, 255], T.ARRAY, T.UINT8),
    ("a.i8", [-128, 0, 127], T.ARRAY, T.INT8),
    ("a.u16", [0, 65535], T.ARRAY, T.UINT16),
    ("a.i16", [-32768, 32767], T.ARRAY, T.INT16),
    ("a.u32", [0, 7, 4294967295], T.ARRAY, T.UINT32),
    ("a.i32", [-2147483648, -1, 2147483647], T.ARRAY, T.INT32),
    ("a.u64", [0, 18446744073709551615], T.ARRAY, T.UINT64),
    ("a.i64", [-9223372036854775808, 9223372036854775807], T.ARRAY, T.INT64),
    ("a.f32", [1.5, -0.0, INF, NAN, 3.4e38], T.ARRAY, T.FLOAT32),
    ("a.f64", [1e300, -2.5, 5e-324], T.ARRAY, T.FLOAT64),
    ("a.bool", [True, False, True], T.ARRAY, T.BOOL),
    ("a.str", ["<s>", "", "▁the", "中文", "\x00nul", "a\nb"], T.ARRAY, T.STRING),
    ("n.ints", [[1, 2, 3], [4]], T.ARRAY, T.ARRAY),
    ("n.floats", [[1.5], [2.5, -0.0]], T.ARRAY, T.ARRAY),
    ("n.strs3", [[["a", "b"]], [["c"], ["", "d"]]], T.ARRAY, T.ARRAY),
    ("n.mixed", [[True, False], [False]], T.ARRAY, T.ARRAY),
    ("general.name", "tp test", T.STRING, None),
]

RNG = np.random.default_rng(7)


def k_quant_bytes(qtype, rows, blocks_per_row):
    """Random bytes shaped as rows of whole blocks of `qtype`."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return RNG.integers(0, 256, size=(rows, blocks_per_row * type_size), dtype=np.uint8)


def values_tensors():
    """(name, array handed to the writer, raw_dtype, ggml type, logical numpy shape)"""
    f32 = RNG.standard_normal((3, 5)).astype(np.float32)
    f16 = RNG.standard_normal(7).astype(np.float16)
    bf16 = RNG.integers(0, 65536, size=(2, 3), dtype=np.uint16)
    i8 = RNG.integers(-128, 128, size=9, dtype=np.int8)
    i32 = RNG.integers(-1000, 1000, size=(2, 3, 4), dtype=np.int32)
    f64 = RNG.standard_normal(3).astype(np.float64)
    f32_4d = RNG.standard_normal((2, 1, 3, 2)).astype(np.float32)
    w = RNG.standard_normal((4, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(w, Q.Q8_0)
    q4 = gguf.quants.quantize(w, Q.Q4_0)
    q6k = k_quant_bytes(Q.Q6_K, 2, 1)
    q4k = k_quant_bytes(Q.Q4_K, 1, 2)
    return [
        ("w.f32", f32, None, Q.F32, f32.shape),
        ("w.f16", f16, None, Q.F16, f16.shape),
        ("w.bf16", bf16, Q.BF16, Q.BF16, bf16.shape),
        ("w.i8", i8, None, Q.I8, i8.shape),
        ("w.i32", i32, None, Q.I32, i32.shape),
        ("w.f64", f64, None, Q.F64, f64.shape),
        ("w.f32_4d", f32_4d, None, Q.F32, f32_4d.shape),
        ("w.q8_0", q8, Q.Q8_0, Q.Q8_0, (4, 64)),
        ("w.q4_0", q4, Q.Q4_0, Q.Q4_0, (4, 64)),
        ("w.q6_k", q6k, Q.Q6_K, Q.Q6_K, (2, 256)),
        ("w.q4_k", q4k, Q.Q4_K, Q.Q4_K, (1, 512)),
    ]


def aligned_tensors():
    f32 = np.arange(3, dtype=np.float32)
    f16 = np.arange(5, dtype=np.float16)
    i8 = np.arange(7, dtype=np.int8)
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 32), Q.Q8_0)
    return [
        ("a.f32", f32, None, Q.F32, f32.shape),
        ("a.f16", f16, None, Q.F16, f16.shape),
        ("a.i8", i8, None, Q.I8, i8.shape),
        ("a.q8_0", q8, Q.Q8_0, Q.Q8_0, (1, 32)),
    ]


def small_tensors():
    f32 = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32)
    q8 = np.arange(34, dtype=np.uint8).reshape(1, 34)
    return [
        ("s.f32", f32, None, Q.F32, f32.shape),
        ("s.q8_0", q8, Q.Q8_0, Q.Q8_0, (1, 32)),
    ]


SMALL_METADATA = [
    ("s.u32", 7, T.UINT32, None),
    ("s.i32", -3, T.INT32, None),
    ("s.f32", 0.5, T.FLOAT32, None),
    ("s.bool", True, T.BOOL, None),
    ("s.str", "hi", T.STRING, None),
    ("s.strs", ["a", "bc"], T.ARRAY, T.STRING),
    ("s.ints", [1, -2], T.ARRAY, T.INT32),
    ("s.nested", [[1], [2, 3]], T.ARRAY, T.ARRAY),
]


def write(out, name, arch, metadata, tensors, alignment=None, endianess=None):
    path = out / name
    kwargs = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), arch, **kwargs)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in metadata:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    expected_tensors = []
    for tname, array, raw_dtype, qtype, shape in tensors:
        w.add_tensor(tname, array, raw_dtype=raw_dtype)
        data_file = f"t_{name}_{tname}.bin"
        (out / data_file).write_bytes(array.tobytes())
        expected_tensors.append(
            {"name": tname, "type": int(qtype), "dims": list(reversed([int(d) for d in shape])), "file": data_file}
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    kvs = [["general.architecture", encode(arch, T.STRING)]]
    if alignment is not None:
        kvs.append(["general.alignment", encode(alignment, T.UINT32)])
    kvs += [[key, encode(value, vtype, sub_type)] for key, value, vtype, sub_type in metadata]
    entry = {"file": name, "metadata": kvs, "tensors": expected_tensors, "alignment": alignment or 32}
    if endianess is None:
        # Where the package's own reader finds the data (a second opinion on offsets and sizes).
        reader = gguf.GGUFReader(str(path))
        entry["reader_data_offset"] = int(reader.data_offset)
        for t, rt in zip(expected_tensors, reader.tensors):
            assert rt.name == t["name"] and [int(d) for d in rt.shape] == t["dims"], (rt.name, rt.shape, t)
            t["reader_offset"] = int(rt.data_offset)
            t["reader_n_bytes"] = int(rt.n_bytes)
    return entry


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    files = [
        write(out, "values.gguf", "tpvalues", METADATA, values_tensors()),
        write(out, "aligned.gguf", "tpaligned", [("x.u8", 1, T.UINT8, None)], aligned_tensors(), alignment=64),
        write(out, "no_tensors.gguf", "tpempty", [("x.str", "only metadata", T.STRING, None)], []),
        write(out, "small.gguf", "tp", SMALL_METADATA, small_tensors()),
        write(out, "bigendian.gguf", "tpbig", [("x.u32", 5, T.UINT32, None)], [], endianess=gguf.GGUFEndian.BIG),
    ]
    (out / "manifest.json").write_text(json.dumps({"files": files}))
    table = {int(t): [t.name, *gguf.GGML_QUANT_SIZES[t]] for t in Q}
    (out / "types.json").write_text(json.dumps(table))


if __name__ == "__main__":
    main()
