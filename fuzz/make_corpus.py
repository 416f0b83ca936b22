#!/usr/bin/env python3
"""Writes the committed fuzz inputs in tests/data/fuzz/<target>/ (docs/format.md's rules, each
broken on purpose): valid files to start from, and hostile ones that every reader must refuse
with a torchpoint::Error. Checksums are computed with libxxhash through ctypes, so the hostile
files get past the checksums and reach the check they are about.

The torch_zip inputs are the .pt files of tests/python/write_python_weights.py (written by
PyTorch, so this step needs python3-torch) and the data.pkl of some of them.

Usage: fuzz/make_corpus.py   (rewrites the generated files; crash regressions stay as they are)
"""
import ctypes
import json
import pathlib
import struct
import subprocess
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "fuzz"
GOLDEN = ROOT / "tests" / "data" / "golden_v1"

_xxhash = ctypes.CDLL("libxxhash.so.0")
_xxhash.XXH3_64bits.restype = ctypes.c_uint64
_xxhash.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(data: bytes) -> str:
    return "%016x" % _xxhash.XXH3_64bits(data, len(data))


def container(entries: str, meta: str, data: bytes = b"", declared_length=None,
              extra_metadata: str = "") -> bytes:
    """A container whose header is `{<entries>,"__metadata__":{...}}` with a right header checksum.
    `entries` is raw JSON text (may be empty), `meta` the torchpoint metadata JSON text."""
    sep = "," if entries else ""
    head = '{%s%s"__metadata__":{"torchpoint":%s%s,"torchpoint_header_xxh3":"%s"}}' % (
        entries, sep, json.dumps(meta), extra_metadata, "0" * 16)
    text = head.encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    n = len(text) if declared_length is None else declared_length
    zeroed = struct.pack("<Q", n) + text
    digits = zeroed.rindex(b"0" * 16)
    whole = zeroed[:digits] + xxh3(zeroed).encode() + zeroed[digits + 16:]
    return whole + data


def meta_text(tensors, state="{}", version="1.0", fmt='"torchpoint"') -> str:
    pairs = ",".join('["%s","%s"]' % (name, checksum) for name, checksum in tensors)
    return '{"format":%s,"format_version":"%s","torchpoint_version":"0.1.0","tensors":[%s],' \
           '"state":%s}' % (fmt, version, pairs, state)


def one_tensor(dtype='"F32"', shape="[2]", offsets="[0,8]", data=b"\0\0\x80?\0\0\0@",
               declared_length=None, **meta):
    entries = '"w":{"dtype":%s,"shape":%s,"data_offsets":%s}' % (dtype, shape, offsets)
    return container(entries, meta_text([("w", xxh3(data))], **meta), data, declared_length)


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def container_corpus():
    files = {}
    for path in sorted(GOLDEN.glob("*.safetensors")) + sorted(GOLDEN.glob("*/*.safetensors")):
        files["golden_" + path.name] = path.read_bytes()
    good = one_tensor()
    files["valid_one_tensor"] = good
    files["valid_no_tensors"] = container("", meta_text([], state='{"step":7,"s":"x"}'))
    files["foreign_plain_safetensors"] = (
        struct.pack("<Q", 56) + b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  '
        + b"\0" * 8)
    # Framing.
    files["empty"] = b""
    files["seven_bytes"] = b"\x08\0\0\0\0\0\0"
    files["length_zero"] = struct.pack("<Q", 0)
    files["length_max_u64"] = struct.pack("<Q", 2**64 - 1) + b"{}"
    files["length_over_bound"] = struct.pack("<Q", 100_000_001) + b"{}"
    files["length_one_past_file"] = one_tensor(declared_length=len(good) - 7)
    for cut in (9, 40, len(good) // 2, len(good) - 9, len(good) - 1):
        files["truncated_%d" % cut] = good[:cut]
    files["trailing_bytes"] = good + b"\0" * 8
    files["no_checksum_tail"] = struct.pack("<Q", 8) + b'{"a":1} '
    files["uppercase_checksum"] = good.replace(good[good.rindex(b'"}}') - 16:good.rindex(b'"}}')],
                                               xxh3(b"").upper().encode())
    files["not_utf8"] = good.replace(b'"w"', b'"\xff"', 1)
    # Offsets and shapes.
    files["offsets_overlap"] = container(
        '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}',
        meta_text([("a", xxh3(b"\0" * 8)), ("b", xxh3(b"\0" * 8))]), b"\0" * 12)
    files["offsets_hole"] = one_tensor(offsets="[8,16]", data=b"\0" * 16)
    files["offsets_reversed"] = one_tensor(offsets="[8,0]")
    files["offsets_end_max_u64"] = one_tensor(offsets="[0,18446744073709551615]")
    files["offsets_past_u64"] = one_tensor(offsets="[0,18446744073709551616]")
    files["offsets_negative"] = one_tensor(offsets="[-8,0]")
    files["offsets_float"] = one_tensor(offsets="[0.0,8.0]")
    files["offsets_three"] = one_tensor(offsets="[0,4,8]")
    files["offsets_string"] = one_tensor(offsets='["0","8"]')
    files["shape_overflows_u64"] = one_tensor(shape="[4294967296,4294967296,16]", offsets="[0,0]")
    files["shape_i64_max"] = one_tensor(shape="[9223372036854775807]", offsets="[0,0]")
    files["shape_negative"] = one_tensor(shape="[-2]")
    files["shape_65_dims"] = one_tensor(shape="[%s]" % ",".join(["1"] * 65), offsets="[0,4]",
                                        data=b"\0" * 4)
    files["shape_huge_zero_size"] = one_tensor(shape="[0,9223372036854775807]", offsets="[0,0]",
                                               data=b"")
    files["misaligned_f64"] = container(
        '"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"d":{"dtype":"F64","shape":[1],"data_offsets":[1,9]}',
        meta_text([("b", xxh3(b"\1")), ("d", xxh3(b"\0" * 8))]), b"\1" + b"\0" * 8)
    # Dtypes.
    files["dtype_unknown"] = one_tensor(dtype='"F128"')
    files["dtype_unsupported_u16"] = one_tensor(dtype='"U16"', shape="[4]")
    files["dtype_lowercase"] = one_tensor(dtype='"f32"')
    files["dtype_not_string"] = one_tensor(dtype="32")
    files["bool_bytes_not_0_or_1"] = one_tensor(dtype='"BOOL"', shape="[8]", data=b"\7" * 8)
    # Metadata.
    files["meta_format_not_string"] = one_tensor(fmt="1")
    files["meta_format_object"] = one_tensor(fmt='{"a":"b"}')
    files["meta_version_newer"] = one_tensor(version="2.0")
    files["meta_version_zero"] = one_tensor(version="0.9")
    files["meta_version_garbage"] = one_tensor(version="a.b")
    files["meta_version_overflow"] = one_tensor(version="99999999999999999999.0")
    files["meta_state_not_object"] = one_tensor(state="[1,2]")
    files["meta_not_json"] = container('"w":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}',
                                       "{not json")
    files["meta_checksum_upper"] = container(
        '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}',
        meta_text([("w", xxh3(b"\1").upper())]), b"\1")
    files["meta_tensor_listed_twice"] = container(
        '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}',
        meta_text([("w", xxh3(b"\1")), ("w", xxh3(b"\1"))]), b"\1")
    files["meta_unknown_tensor"] = container("", meta_text([("ghost", xxh3(b""))]))
    files["meta_tensor_without_checksum"] = container(
        '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', meta_text([]), b"\1")
    files["meta_data_checksum_wrong"] = container(
        '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', meta_text([("w", xxh3(b"\2"))]),
        b"\1")
    files["metadata_not_object"] = struct.pack("<Q", 24) + b'{"__metadata__":[1,2,3]}'
    files["entry_not_object"] = container('"w":[1,2]', meta_text([]))
    files["duplicate_keys"] = container(
        '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}', meta_text([("w", xxh3(b"\1\2"))]),
        b"\1\2")
    # Nesting (each once overflowed the stack, see docs/format.md).
    files["deep_shape"] = one_tensor(shape=deep(12000))
    files["deep_state"] = container("", meta_text([], state='{"x":%s}' % deep(12000)))
    files["deep_tensor_pair"] = container("", meta_text([]).replace('"tensors":[]',
                                                                   '"tensors":[%s]' % deep(12000)))
    files["deep_just_over_limit"] = container("", meta_text([], state='{"x":%s}' % deep(1000)))
    files["deep_at_limit"] = container("", meta_text([], state='{"x":%s}' % deep(997)))
    return files


def manifest(body: dict, replace=("", "")) -> bytes:
    text = json.dumps(body, indent=2)[:-2].replace(*replace)
    text += ',\n  "manifest_xxh3": "%s"\n}\n' % ("0" * 16)
    digits = text.rindex("0" * 16)
    return (text[:digits] + xxh3(text.encode()) + text[digits + 16:]).encode()


def manifest_corpus():
    golden = (GOLDEN / "checkpoint_1" / "manifest.json").read_bytes()
    base = json.loads(golden)
    del base["manifest_xxh3"]
    files = {"golden_manifest": golden, "valid_rebuilt": manifest(base)}

    def changed(**fields):
        body = json.loads(json.dumps(base))
        for key, value in fields.items():
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return manifest(body)

    def changed_file(name, **fields):
        body = json.loads(json.dumps(base))
        entry = body["files"][name]
        for key, value in fields.items():
            if value is None:
                entry.pop(key, None)
            else:
                entry[key] = value
        return manifest(body)

    files["empty"] = b""
    files["no_tail"] = golden[: golden.rindex(b",\n")] + b"\n}\n"
    files["truncated_half"] = golden[: len(golden) // 2]
    files["checksum_wrong"] = golden.replace(golden[-21:-5], b"0123456789abcdef")
    files["checksum_upper"] = golden.replace(golden[-21:-5], golden[-21:-5].upper())
    files["format_object"] = changed(format={"run": "golden"})
    files["format_number"] = changed(format=7)
    files["version_object"] = changed(format_version={"major": 1})
    files["version_newer"] = changed(format_version="2.0")
    files["version_garbage"] = changed(format_version="1")
    files["step_missing"] = changed(step=None)
    files["step_string"] = changed(step="12")
    files["step_too_big"] = changed(step=2**64)
    files["step_float"] = changed(step=12.5)
    files["step_u64"] = changed(step=2**63)
    files["created_float_huge"] = changed(created_unix_ms=1e300)
    files["files_array"] = changed(files=[1, 2])
    files["files_missing"] = changed(files=None)
    golden_metadata = '"metadata": {\n    "run": "golden"\n  }'
    files["metadata_deep"] = manifest(base, (golden_metadata, '"metadata": ' + deep(900)))
    files["metadata_too_deep"] = manifest(base, (golden_metadata, '"metadata": ' + deep(12000)))
    files["created_string"] = changed(created_unix_ms="now")
    files["file_size_negative"] = changed_file("model.safetensors", size=-1)
    files["file_size_wrong"] = changed_file("model.safetensors", size=321)
    files["file_size_huge"] = changed_file("model.safetensors", size=2**64 - 1)
    files["file_checksum_upper"] = changed_file("model.safetensors", header_xxh3="F19BF5E9CD400475")
    files["file_checksum_other"] = changed_file("model.safetensors",
                                                header_xxh3="4f9834a20d5c2733")
    files["file_component_missing"] = changed_file("model.safetensors", component=None)
    files["file_component_mismatch"] = changed_file("model.safetensors", component="optimizer")
    body = json.loads(json.dumps(base))
    body["files"]["../model.safetensors"] = body["files"].pop("model.safetensors")
    body["files"]["../model.safetensors"]["component"] = "../model"
    files["file_name_escapes"] = manifest(body)
    body = json.loads(json.dumps(base))
    body["files"]["ghost.safetensors"] = {"component": "ghost", "size": 1,
                                          "header_xxh3": "0" * 16}
    files["file_missing_on_disk"] = manifest(body)
    body = json.loads(json.dumps(base))
    del body["files"]["optimizer.safetensors"]
    files["file_unlisted_on_disk"] = manifest(body)
    return files


def filename_corpus():
    names = ["checkpoint_0", "checkpoint_7", "checkpoint_07", "checkpoint_", "checkpoint_-1",
             "checkpoint_18446744073709551615", "checkpoint_18446744073709551616",
             "checkpoint_7.tmp-123-0123456789abcdef", ".tmp-1-a", "x.tmp-99999999999999999999-ab",
             "x.tmp--ab", "x.tmp-1-", "x.tmp-1-ABC", "model.safetensors", ".safetensors",
             "manifest.json", "a/b/c", "/", "//", "a//", "", ".", "..", "epoch-03-loss-1.026.ckpt"]
    return {"name_%02d" % i: name.encode() for i, name in enumerate(names)}


def torch_zip_corpus():
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = ROOT / "tests" / "python" / "write_python_weights.py"
        subprocess.run(["/usr/bin/python3", str(script), tmp], check=True,
                       stdout=subprocess.DEVNULL)
        for path in sorted(pathlib.Path(tmp).glob("*.pt")):
            files[path.name] = path.read_bytes()
        for name in ("bn", "buffers", "ordered", "a_list", "unknown_global", "parameter"):
            archive = zipfile.ZipFile(pathlib.Path(tmp) / (name + ".pt"))
            pickle = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            files[name + ".pkl"] = archive.read(pickle)
    # Python Accelerate's files (optimizer and scheduler state dicts, random states with NumPy
    # arrays and bytes, a custom object), written by the project venv's accelerate.
    venv_python = ROOT / ".venv" / "bin" / "python"
    if venv_python.exists():
        with tempfile.TemporaryDirectory() as tmp:
            script = ROOT / "tests" / "python" / "accelerate_checkpoints.py"
            subprocess.run([str(venv_python), str(script), "write", tmp], check=True,
                           stdout=subprocess.DEVNULL)
            for name in ("optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"):
                path = pathlib.Path(tmp) / "adamw" / name
                files["accelerate_" + name] = path.read_bytes()
                archive = zipfile.ZipFile(path)
                pickle = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
                files["accelerate_" + name + ".data.pkl"] = archive.read(pickle)
    return files


def write(target, files):
    directory = OUT / target
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if not old.name.startswith("crash-"):  # regressions found by fuzzing stay
            old.unlink()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    print("%s: %d files, %d bytes" % (directory.relative_to(ROOT), len(files),
                                      sum(len(d) for d in files.values())))


if __name__ == "__main__":
    write("container", container_corpus())
    write("manifest", manifest_corpus())
    write("filename", filename_corpus())
    try:
        write("torch_zip", torch_zip_corpus())
    except (OSError, subprocess.CalledProcessError) as e:
        print("torch_zip: left as it is (%s; install python3-torch)" % e)
