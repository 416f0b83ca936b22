#!/usr/bin/python3
"""Checks a file written by `torchpoint export` with PyTorch itself, the independent client.

Usage:
    export_check.py OUT.pt EXPECTED.json

OUT.pt is loaded with torch.load three times: as a new user calls it (weights_only=True, the
default since PyTorch 2.6), with weights_only=False, and memory-mapped (mmap=True, which needs
every storage 64-byte aligned in the file). Each must return a plain dict of str -> Tensor.
EXPECTED.json (written by tests/cli_test.cc from the checkpoint's own tensors) is a list, in
the checkpoint's order, of
    {"name": "fc.weight", "dtype": "torch.float32", "shape": [2, 3],
     "values": [...], "hex": "<the tensor's bytes, row-major, little endian>"}
where "values" is the flat list of elements: floats exact (every float16/bfloat16/float32
element is exactly a double), or the strings "nan", "inf", "-inf"; integers as JSON integers;
bools as true/false. A float must match bit for bit: -0.0 differs from 0.0.

Prints one line per problem and exits 1 if there is any, 0 (printing "ok: ...") otherwise,
2 on a usage error or when PyTorch cannot be imported.
"""

import json
import math
import sys


def same_float(actual, expected):
    if isinstance(expected, str):
        if expected == "nan":
            return math.isnan(actual)
        return actual == (math.inf if expected == "inf" else -math.inf)
    return (not math.isnan(actual) and actual == expected
            and math.copysign(1.0, actual) == math.copysign(1.0, expected))


def tensor_bytes(torch, tensor):
    t = tensor.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: same bits as int16
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def check(torch, loaded, expected):
    problems = []
    if type(loaded) is not dict:
        return ["torch.load returned %s, not a dict" % type(loaded).__name__]
    names = [e["name"] for e in expected]
    if list(loaded.keys()) != names:
        problems.append("keys %s, expected %s" % (list(loaded.keys()), names))
    for e in expected:
        name = e["name"]
        if name not in loaded:
            continue
        t = loaded[name]
        if not isinstance(t, torch.Tensor):
            problems.append("%s: a %s, not a tensor" % (name, type(t).__name__))
            continue
        if str(t.dtype) != e["dtype"]:
            problems.append("%s: dtype %s, expected %s" % (name, t.dtype, e["dtype"]))
            continue
        if list(t.shape) != e["shape"]:
            problems.append("%s: shape %s, expected %s" % (name, list(t.shape), e["shape"]))
            continue
        values = t.flatten().tolist()
        if len(values) != len(e["values"]):
            problems.append("%s: %d values, expected %d" % (name, len(values), len(e["values"])))
            continue
        for i, (a, x) in enumerate(zip(values, e["values"])):
            ok = same_float(a, x) if t.is_floating_point() else (a == x and type(a) is type(x))
            if not ok:
                problems.append("%s[%d]: %r, expected %r" % (name, i, a, x))
        if tensor_bytes(torch, t).hex() != e["hex"]:
            problems.append("%s: bytes %s, expected %s"
                            % (name, tensor_bytes(torch, t).hex(), e["hex"]))
    return problems


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as e:
        print("cannot import torch (run with the project venv's python): %s" % e,
              file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        expected = json.load(f)
    problems = []
    for how, kwargs in (("torch.load(path)", {}),
                        ("weights_only=False", {"weights_only": False}),
                        ("mmap=True", {"mmap": True, "weights_only": True})):
        try:
            loaded = torch.load(argv[1], **kwargs)
        except Exception as e:  # the message is the finding
            problems.append("%s failed: %s: %s" % (how, type(e).__name__, e))
            continue
        problems += ["%s: %s" % (how, p) for p in check(torch, loaded, expected)]
    for p in problems:
        print("%s: %s" % (argv[1], p))
    if problems:
        return 1
    print("ok: %s holds %d tensors equal to the checkpoint's" % (argv[1], len(expected)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
