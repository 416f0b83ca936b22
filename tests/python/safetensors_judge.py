"""Reads files that torchpoint wrote with the real safetensors library and checks every tensor.

Usage: safetensors_judge.py EXPECTED.json

EXPECTED.json (written by the C++ tests from torchpoint's own, checksum-verified load of each
file) is {"blob": PATH, "files": [{"path": PATH, "tensors": [{"name": ..., "dtype": "F32",
"shape": [2, 3], "offset": N, "length": N}, ...]}, ...]}; each tensor's bytes (row-major,
little-endian) are `length` bytes at `offset` in the blob.

Each file is opened twice, as Python users do: safetensors.safe_open(path, framework="pt")
(keys, metadata, get_tensor, and get_slice for the first row of a tensor) and
safetensors.torch.load_file(path). Both must give exactly the expected names, dtypes, shapes
and bytes. Prints one line per problem and exits 1 if there is any, 0 otherwise; 2 when the
packages cannot be imported.
"""
import json
import sys

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as e:
    print("cannot import torch and safetensors (run with the project venv's python): %s" % e,
          file=sys.stderr)
    sys.exit(2)

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def raw(t):
    """The tensor's bytes, row-major (works for every dtype, 0-d and empty tensors too)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_tensor(where, t, want, blob):
    problems = []
    if t.dtype != DTYPES[want["dtype"]]:
        problems.append("%s: dtype %s, expected %s" % (where, t.dtype, want["dtype"]))
    if list(t.shape) != want["shape"]:
        problems.append("%s: shape %s, expected %s" % (where, list(t.shape), want["shape"]))
    if not problems:
        expected = blob[want["offset"]:want["offset"] + want["length"]]
        got = raw(t)
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                         min(len(got), len(expected)))
            problems.append("%s: bytes differ (%d bytes, expected %d; first difference at "
                            "byte %d)" % (where, len(got), len(expected), first))
    return problems


def check_file(spec, blob):
    path = spec["path"]
    want = {t["name"]: t for t in spec["tensors"]}
    problems = []
    with safe_open(path, framework="pt") as f:
        if sorted(f.keys()) != sorted(want):
            problems.append("%s: safe_open keys %s, expected %s" % (path, sorted(f.keys()),
                                                                    sorted(want)))
        meta = f.metadata() or {}
        if not isinstance(meta.get("torchpoint"), str):
            problems.append("%s: metadata has no 'torchpoint' string: %s" % (path, meta))
        for name in f.keys():
            if name not in want:
                continue
            problems += check_tensor("%s: safe_open %s" % (path, name), f.get_tensor(name),
                                     want[name], blob)
            shape = want[name]["shape"]
            if shape and shape[0] > 0:
                row = f.get_slice(name)[0:1]
                if raw(row) != raw(f.get_tensor(name)[0:1]):
                    problems.append("%s: get_slice(%s)[0:1] differs from get_tensor" %
                                    (path, name))
    loaded = load_file(path)
    if sorted(loaded) != sorted(want):
        problems.append("%s: load_file keys %s, expected %s" % (path, sorted(loaded),
                                                                sorted(want)))
    for name, t in loaded.items():
        if name in want:
            problems += check_tensor("%s: load_file %s" % (path, name), t, want[name], blob)
    return problems


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        expected = json.load(f)
    with open(expected["blob"], "rb") as f:
        blob = f.read()
    problems = []
    count = 0
    for spec in expected["files"]:
        problems += check_file(spec, blob)
        count += len(spec["tensors"])
    for p in problems:
        print(p)
    if problems:
        return 1
    print("ok: %d files, %d tensors read bit-identical by safetensors %s" %
          (len(expected["files"]), count, __import__("safetensors").__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
