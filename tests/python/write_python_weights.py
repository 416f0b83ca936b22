#!/usr/bin/python3
"""Writes weights the way Python users do, for tests/interop_test.cc.

Usage: write_python_weights.py OUT_DIR

OUT_DIR/model.pt           torch.save(dict(model.state_dict())) of Sequential(Linear(4,3), ReLU, Linear(3,2))
OUT_DIR/ordered.pt         torch.save(model.state_dict()) of the same model: an OrderedDict
OUT_DIR/plain.safetensors  the same tensors in a safetensors file written with struct/json only
                           (no torchpoint metadata, header keys in sorted order, as other tools do)
OUT_DIR/expected.json      every tensor's shape and values, as float.hex strings

OUT_DIR/bn.pt              torch.save(model.state_dict()) of Sequential(Linear(4,3), BatchNorm1d(3),
                           Linear(3,2)) after two training steps; 0.weight is a transposed view,
                           0.bias and 2.bias are slices of one storage (offsets 5 and 2)
OUT_DIR/buffers.pt         torch.save(module.state_dict()) of a module whose buffers are float32,
                           float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool, a
                           0-d tensor, an empty tensor and special floats
OUT_DIR/newer.pt           torch.save of the dtypes torch 2.x writes with _rebuild_tensor_v3 over an
                           untyped storage: uint16, uint32, uint64, float8_e4m3fn, float8_e5m2
                           (random bytes), and a uint16 slice sharing the first one's storage
OUT_DIR/zip64.pt           bn.pt's records with every size and offset in ZIP64 extra fields, as in
                           archives over 4 GiB (written by hand; torch.load checks it)
OUT_DIR/<name>.raw         the bytes of every tensor of <name>.pt, contiguous, in order
OUT_DIR/tensors.json       for bn and buffers: per tensor, dtype, shape, stride, storage offset
                           and [begin, end) of its bytes in <name>.raw
Hostile and wrong files (made from bn.pt; zipfile writes correct CRCs, so only the named defect
is there):
OUT_DIR/compressed.pt      bn.pt's records, deflated
OUT_DIR/bad_opcode.pt      data.pkl with byte 0xff where its first GLOBAL was
OUT_DIR/past_end.pt        0.bias's storage offset 5 raised to 250 (the storage has 10 elements)
OUT_DIR/huge_storage.pt    torch.save({"w": ones(2)}) whose storage claims 2^62 float32 elements
                           (2^64 bytes: more than a 64-bit size holds)
OUT_DIR/unknown_global.pt  torch.save({"w": tensor, "run": os.system})
OUT_DIR/not_tensor.pt      torch.save({"w": tensor, "step": 3})
OUT_DIR/a_list.pt          torch.save([tensor])
OUT_DIR/legacy.pt          torch.save(..., _use_new_zipfile_serialization=False): the pre-1.6 format
OUT_DIR/parameter.pt       torch.save({"w": nn.Parameter(arange(6).reshape(2, 3))})
"""
import collections
import json
import os
import struct
import sys
import zipfile
import zlib

import torch

DTYPE_NAMES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
    torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
    torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
}


def raw_bytes(t):
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def describe(out, name, state):
    """Writes OUT/<name>.raw and returns the tensors' description for tensors.json."""
    info = {}
    data = b""
    for key, t in state.items():
        raw = raw_bytes(t)
        info[key] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                     "stride": list(t.stride()), "offset": t.storage_offset(),
                     "bytes": [len(data), len(data) + len(raw)]}
        data += raw
    with open(os.path.join(out, name + ".raw"), "wb") as f:
        f.write(data)
    return {"order": list(state.keys()), "tensors": info}


def rezip(src, dst, compress=False, patch=None):
    """Copies the records of zip `src` to `dst`, optionally deflated or with data.pkl patched."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", method) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if patch is not None and info.filename.endswith("/data.pkl"):
                data = patch(data)
            zout.writestr(info.filename, data)


def zip64_copy(src, dst):
    """Writes the records of zip `src` to `dst` with 0xffffffff in every size and offset field
    and the values in ZIP64 extra fields, as archives over 4 GiB have them."""
    with zipfile.ZipFile(src) as z:
        records = [(i.filename.encode(), z.read(i.filename)) for i in z.infolist()]
    out = b""
    central = b""
    big = 0xffffffff
    for name, data in records:
        crc = zlib.crc32(data)
        offset = len(out)
        extra = struct.pack("<HHQQ", 1, 16, len(data), len(data))
        out += struct.pack("<IHHHHHIIIHH", 0x04034b50, 45, 0, 0, 0, 0x21, crc, big, big,
                           len(name), len(extra)) + name + extra + data
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014b50, 45, 45, 0, 0, 0, 0x21, crc, big,
                               big, len(name), len(extra), 0, 0, 0, 0, big) + name + extra
    directory = len(out)
    out += central
    end64 = len(out)
    out += struct.pack("<IQHHIIQQQQ", 0x06064b50, 44, 45, 45, 0, 0, len(records), len(records),
                       len(central), directory)
    out += struct.pack("<IIQI", 0x07064b50, 0, end64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054b50, 0, 0, 0xffff, 0xffff, big, big, 0)
    with open(dst, "wb") as f:
        f.write(out)


def replace_once(data, old, new):
    assert data.count(old) == 1, (old, data.count(old))
    return data.replace(old, new)


def batchnorm_model():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
    with torch.no_grad():
        # A transposed view: saved with strides (1, 4), not contiguous.
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())
        # Two parameters in one storage, at offsets 5 and 2.
        shared = torch.randn(10)
        model[0].bias = torch.nn.Parameter(shared[5:8])
        model[2].bias = torch.nn.Parameter(shared[2:4])
    return model


class Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.register_buffer("f32", torch.randn(3, 4))
        self.register_buffer("f64", torch.randn(5, dtype=torch.float64))
        self.register_buffer("f16", torch.randn(2, 3).half())
        self.register_buffer("bf16", torch.randn(4).bfloat16())
        self.register_buffer("i64", torch.tensor([-(2**62), -1, 0, 7, 2**62 + 12345]))
        self.register_buffer("i32", torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32))
        self.register_buffer("i16", torch.tensor([-300, 300], dtype=torch.int16))
        self.register_buffer("i8", torch.tensor([-128, 127], dtype=torch.int8))
        self.register_buffer("u8", torch.tensor([0, 200, 255], dtype=torch.uint8))
        self.register_buffer("flags", torch.tensor([[True, False], [False, True]]))
        self.register_buffer("scalar", torch.tensor(2.5, dtype=torch.float64))
        self.register_buffer("empty", torch.zeros(0, 3))
        self.register_buffer("special", torch.tensor([float("nan"), -0.0, float("inf"),
                                                      -float("inf"), 1e-45]))


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

    tensors = {}
    bn = batchnorm_model().state_dict()
    assert isinstance(bn, collections.OrderedDict) and not bn["0.weight"].is_contiguous()
    torch.save(bn, os.path.join(out, "bn.pt"))
    tensors["bn"] = describe(out, "bn", bn)
    buffers = Buffers().state_dict()
    torch.save(buffers, os.path.join(out, "buffers.pt"))
    tensors["buffers"] = describe(out, "buffers", buffers)
    gen = torch.Generator().manual_seed(11)
    newer = collections.OrderedDict()
    for dtype, shape in ((torch.uint16, (3, 4)), (torch.uint32, (5,)), (torch.uint64, (2, 2)),
                         (torch.float8_e4m3fn, (2, 3)), (torch.float8_e5m2, (7,))):
        size = torch.empty(0, dtype=dtype).element_size()
        count = size * int(torch.Size(shape).numel())
        raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
        newer[DTYPE_NAMES[dtype]] = raw.view(dtype).reshape(shape)
    newer["uint16_row"] = newer["uint16"][1]  # a view into the same storage, offset 4
    torch.save(newer, os.path.join(out, "newer.pt"))
    tensors["newer"] = describe(out, "newer", newer)
    with open(os.path.join(out, "tensors.json"), "w") as f:
        json.dump(tensors, f)

    bn_path = os.path.join(out, "bn.pt")
    zip64_copy(bn_path, os.path.join(out, "zip64.pt"))
    reloaded = torch.load(os.path.join(out, "zip64.pt"))
    assert all(torch.equal(reloaded[k], bn[k]) for k in bn)
    rezip(bn_path, os.path.join(out, "compressed.pt"), compress=True)
    rezip(bn_path, os.path.join(out, "bad_opcode.pt"),
          patch=lambda d: replace_once(d, b"ccollections\nOrderedDict\n",
                                       b"\xffcollections\nOrderedDict\n"))
    # BINPERSID, then BININT1 5: the storage offset of 0.bias.
    rezip(bn_path, os.path.join(out, "past_end.pt"),
          patch=lambda d: replace_once(d, b"QK\x05", b"QK\xfa"))
    w = torch.ones(2)
    two = os.path.join(out, "two.pt")
    torch.save({"w": w}, two)
    # The storage's element count (BININT1 2, before TUPLE, BINPUT 7, BINPERSID) becomes a
    # LONG1 of 2^62.
    rezip(two, os.path.join(out, "huge_storage.pt"),
          patch=lambda d: replace_once(d, b"K\x02tq\x07Q",
                                       b"\x8a\x08" + (2 ** 62).to_bytes(8, "little") + b"tq\x07Q"))
    torch.save({"w": w, "run": os.system}, os.path.join(out, "unknown_global.pt"))
    torch.save({"w": w, "step": 3}, os.path.join(out, "not_tensor.pt"))
    torch.save([w], os.path.join(out, "a_list.pt"))
    torch.save(bn, os.path.join(out, "legacy.pt"), _use_new_zipfile_serialization=False)
    param = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    torch.save({"w": param}, os.path.join(out, "parameter.pt"))


if __name__ == "__main__":
    main()
