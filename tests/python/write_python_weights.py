#!/usr/bin/python3
"""Writes weights the way Python users do, for tests/interop_test.cc.

Usage: write_python_weights.py OUT_DIR

OUT_DIR/model.pt           torch.save(dict(model.state_dict())) of Sequential(Linear(4,3), ReLU, Linear(3,2))
OUT_DIR/ordered.pt         torch.save(model.state_dict()): an OrderedDict
OUT_DIR/plain.safetensors  the same tensors in a safetensors file written with struct/json only
                           (no torchpoint metadata, header keys in sorted order, as other tools do)
OUT_DIR/expected.json      every tensor's shape and values, as float.hex strings
"""
import json
import os
import struct
import sys

import torch


def main():
    out = sys.argv[1]
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    state = model.state_dict()
    torch.save(dict(state), os.path.join(out, "model.pt"))
    torch.save(state, os.path.join(out, "ordered.pt"))

    expected = {}
    header = {}
    data = b""
    for name in sorted(state):
        t = state[name].contiguous()
        values = t.flatten().tolist()
        expected[name] = {"shape": list(t.shape), "values": [float(v).hex() for v in values]}
        raw = struct.pack("<%df" % len(values), *values)
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(os.path.join(out, "plain.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main()
