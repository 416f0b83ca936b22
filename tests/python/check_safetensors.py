#!/usr/bin/python3
"""An independent checker for safetensors files as torchpoint writes them.

It knows nothing of torchpoint's C++ code: it reads the bytes of each file and checks them
against the safetensors specification and against the language-neutral parts of torchpoint's
container format (docs/format.md). Only the Python standard library is used, so it runs
anywhere Python 3.8+ does (the project runs it with /usr/bin/python3, Python 3.11).

Usage:
    check_safetensors.py [--expect-json PATH] FILE [FILE...]

Prints one line per problem, naming the file (and the tensor when there is one), then a
summary line. Exits 0 when every file passes, 1 when any problem was found, 2 on a usage
error.

--expect-json PATH names a JSON file of the form
    {"<file>": {"<tensor>": {"dtype": "F32", "shape": [2, 3], "values": [...]}}}
where "values" is the flat, row-major list of the tensor's elements. Floats are compared bit
for bit (after decoding the file's bytes with struct; F16 with format 'e', BF16 by shifting
its 16 bits into the top of a float32), so an expected float must be the exact value of the
stored element (e.g. 0.10000000149011612 for float32(0.1)). -0.0 and 0.0 differ. An element
may also be given as the string "nan", "inf" or "-inf", or as "0x<hex>" for its exact bits
(the element's bytes read as a little-endian unsigned integer), which also pins NaN payloads.
BOOL elements are given as true/false (or 0/1). A <file> key matches a FILE argument when it
is the same string, the same path after os.path.abspath, or, failing both, the same base name
(when that is unambiguous). Every tensor of an expected file must be listed and vice versa.

What is checked (each rule is one check_* function below, usable from tests):
  safetensors:
    - 8-byte little-endian u64 header length N, at most 100,000,000 and at most the file size - 8;
    - N bytes of UTF-8 text that begins with '{' and holds one JSON object, followed only by
      spaces (0x20); no duplicate keys, no NaN/Infinity, no lone surrogates;
    - every key except "__metadata__" is a tensor entry {"dtype", "shape", "data_offsets"}:
      dtype one of BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64 F8_E4M3 F8_E5M2, shape a
      list of non-negative integers, data_offsets [begin, end] with begin <= end and
      end - begin == prod(shape) * element size;
    - the offsets tile the data buffer (the bytes after the header) with no hole and no
      overlap, and the buffer ends exactly at the end of the file;
    - "__metadata__", if present, is an object mapping strings to strings;
    - the data starts (8 + N) at a multiple of 8, and every tensor's absolute offset is a
      multiple of its element size.
  torchpoint (format version 1.x):
    - __metadata__["torchpoint"] is a string holding a JSON object with "format": "torchpoint",
      "format_version": "1.<minor>", "tensors" listing [name, checksum] for every tensor (and nothing else), with
      16 lowercase hex digits, and "state", an object;
    - __metadata__["torchpoint_header_xxh3"] is 16 lowercase hex digits and the header's text
      ends with '"torchpoint_header_xxh3":"<16 hex>"}}' followed only by spaces (so it is the
      last key of __metadata__, which is the last key of the header);
    - the layout is the writer's: tensors in data order by descending element size, ties in
      the order of "tensors"; header keys in data order; padding shorter than the alignment.
  XXH3 cannot be computed with the standard library, so checksums are checked for form only.
"""

import json
import math
import os
import struct
import sys

MAX_HEADER_SIZE = 100_000_000
DATA_ALIGNMENT = 8
DIRECT_ALIGNMENT = 4096          # where the data starts when the writer used O_DIRECT
DIRECT_MIN_DATA = 1 << 20        # the writer uses O_DIRECT only from this much data on
METADATA_KEY = "__metadata__"
TORCHPOINT_KEY = "torchpoint"
HEADER_CHECKSUM_KEY = "torchpoint_header_xxh3"
FORMAT_NAME = "torchpoint"
SUPPORTED_MAJOR = 1
CHECKSUM_HEX_LENGTH = 16
HEX_DIGITS = frozenset("0123456789abcdef")
MAX_MISMATCHES_SHOWN = 5

# safetensors dtype -> (element size in bytes, struct format or None for a custom decoder)
DTYPES = {
    "BOOL": (1, "B"),
    "U8": (1, "B"),
    "I8": (1, "b"),
    "I16": (2, "h"),
    "U16": (2, "H"),
    "F16": (2, "e"),
    "BF16": (2, None),
    "I32": (4, "i"),
    "U32": (4, "I"),
    "F32": (4, "f"),
    "F64": (8, "d"),
    "I64": (8, "q"),
    "U64": (8, "Q"),
    "F8_E4M3": (1, None),
    "F8_E5M2": (1, None),
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})
INT_DTYPES = frozenset({"U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def quote(name):
    """A tensor or key name as it appears in messages: single-quoted, control characters escaped."""
    text = json.dumps(name, ensure_ascii=False)[1:-1]
    # Lone surrogates (from \u escapes) cannot be printed as UTF-8: show them escaped.
    return "'" + text.encode("utf-8", "backslashreplace").decode("utf-8") + "'"


def where(path, tensor=None):
    return "%s: tensor %s" % (path, quote(tensor)) if tensor is not None else path


def is_json_int(value):
    """A JSON integer (Python's json gives bool for true/false, which is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_checksum_hex(value):
    return (isinstance(value, str) and len(value) == CHECKSUM_HEX_LENGTH
            and all(c in HEX_DIGITS for c in value))


def product(values):
    result = 1
    for v in values:
        result *= v
    return result


class JsonObject(dict):
    """A parsed JSON object that remembers its key order and any duplicate keys."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.key_order = []
        self.duplicates = []
        seen = set()
        for key, _ in pairs:
            if key in seen:
                if key not in self.duplicates:
                    self.duplicates.append(key)
            else:
                seen.add(key)
                self.key_order.append(key)


def _refuse_constant(name):
    raise ValueError("%s is not valid JSON" % name)


def parse_json_prefix(text):
    """Parses the JSON value at the start of `text`; returns (value, end index).

    Strict: NaN/Infinity are refused; objects come back as JsonObject. Raises ValueError
    (json.JSONDecodeError is one) or RecursionError.
    """
    decoder = json.JSONDecoder(object_pairs_hook=JsonObject, parse_constant=_refuse_constant)
    return decoder.raw_decode(text, 0)


def json_problems(value, context, path_in_json="$"):
    """Duplicate keys and lone surrogates anywhere inside a parsed JSON value."""
    problems = []
    stack = [(value, path_in_json)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if any("\ud800" <= c <= "\udfff" for c in v):
                problems.append("%s: string at %s holds a lone UTF-16 surrogate (\\u escape), "
                                "which is not valid Unicode" % (context, at))
        elif isinstance(v, JsonObject):
            for key in v.duplicates:
                problems.append("%s: key %s appears more than once in the object at %s"
                                % (context, quote(key), at))
            for key in v.key_order:
                if any("\ud800" <= c <= "\udfff" for c in key):
                    problems.append("%s: key %s in the object at %s holds a lone UTF-16 "
                                    "surrogate (\\u escape), which is not valid Unicode"
                                    % (context, quote(key), at))
                stack.append((v[key], "%s[%s]" % (at, json.dumps(key))))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                stack.append((item, "%s[%d]" % (at, i)))
    return problems


class Entry:
    """One validated tensor entry of the header."""

    def __init__(self, name, dtype, shape, begin, end):
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.begin = begin
        self.end = end

    @property
    def element_size(self):
        return DTYPES[self.dtype][0]

    @property
    def numel(self):
        return product(self.shape)


# ---------------------------------------------------------------------------------------------
# safetensors rules
# ---------------------------------------------------------------------------------------------

def check_header_length(path, first8, file_size):
    """Rule: 8-byte little-endian u64 N, N <= 100,000,000, 8 + N <= file size.

    Returns (N or None, problems).
    """
    if file_size < 8 or len(first8) < 8:
        return None, ["%s: the file is %d bytes long, too short for the 8-byte header length"
                      % (path, file_size)]
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_SIZE:
        return None, ["%s: header length %d exceeds the limit of %d bytes"
                      % (path, n, MAX_HEADER_SIZE)]
    if n > file_size - 8:
        return None, ["%s: header length %d runs past the end of the file (%d bytes after the "
                      "length field)" % (path, n, file_size - 8)]
    return n, []


def check_header_text(path, raw):
    """Rule: the header is UTF-8 and begins with '{'. Returns (text or None, problems)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, ["%s: the header is not valid UTF-8 (byte %d of the header: %s)"
                      % (path, e.start, e.reason)]
    if not text.startswith("{"):
        return None, ["%s: the header does not begin with '{' (it begins with %s)"
                      % (path, json.dumps(text[:1]))]
    return text, []


def check_header_json(path, text):
    """Rule: the header is one JSON object followed only by spaces (0x20).

    Returns (root JsonObject or None, problems).
    """
    try:
        root, end = parse_json_prefix(text)
    except (ValueError, RecursionError) as e:
        return None, ["%s: the header is not valid JSON (%s)" % (path, e)]
    problems = []
    if not isinstance(root, JsonObject):
        return None, ["%s: the header is not a JSON object" % path]
    padding = text[end:]
    if padding.strip(" "):
        bad = next(i for i, c in enumerate(padding) if c != " ")
        problems.append("%s: the header's JSON is followed by %s at header byte %d; only spaces "
                        "(0x20) may pad it" % (path, json.dumps(padding[bad]),
                                               len(text[:end + bad].encode("utf-8"))))
    problems += json_problems(root, "%s: header" % path)
    return root, problems


def check_tensor_entry(path, name, value):
    """Rule: a tensor entry has a known dtype, a shape of non-negative integers and
    data_offsets [begin, end] whose span is prod(shape) * element size.

    Returns (Entry or None, problems).
    """
    at = where(path, name)
    if not isinstance(value, dict):
        return None, ["%s: the header entry is not an object" % at]
    problems = []
    for key in ("dtype", "shape", "data_offsets"):
        if key not in value:
            problems.append("%s: the entry has no \"%s\"" % (at, key))
    extra = [k for k in value if k not in ("dtype", "shape", "data_offsets")]
    if extra:
        problems.append("%s: the entry has unknown keys %s"
                        % (at, ", ".join(quote(k) for k in extra)))
    if problems:
        return None, problems
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        problems.append("%s: unknown dtype %s (allowed: %s)"
                        % (at, json.dumps(dtype), " ".join(DTYPES)))
    if not isinstance(shape, list) or not all(is_json_int(d) and d >= 0 for d in shape):
        problems.append("%s: shape %s is not a list of non-negative integers"
                        % (at, json.dumps(shape)))
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(is_json_int(o) and o >= 0 for o in offsets)):
        problems.append("%s: data_offsets %s is not a list of two non-negative integers"
                        % (at, json.dumps(offsets)))
    elif offsets[0] > offsets[1]:
        problems.append("%s: data_offsets %s has begin after end" % (at, json.dumps(offsets)))
    if problems:
        return None, problems
    entry = Entry(name, dtype, list(shape), offsets[0], offsets[1])
    needed = entry.numel * entry.element_size
    if entry.end - entry.begin != needed:
        return None, ["%s: shape %s of %s needs %d bytes but data_offsets %s span %d"
                      % (at, json.dumps(shape), dtype, needed, json.dumps(offsets),
                         entry.end - entry.begin)]
    return entry, []


def check_tensor_entries(path, root):
    """Applies check_tensor_entry to every key but __metadata__. Returns (entries, problems)."""
    entries, problems = [], []
    for name in root.key_order:
        if name == METADATA_KEY:
            continue
        entry, found = check_tensor_entry(path, name, root[name])
        problems += found
        if entry is not None:
            entries.append(entry)
    return entries, problems


def check_offsets_tile(path, entries, data_size):
    """Rule: the tensors' byte ranges tile [0, data_size): no hole, no overlap, and the data
    buffer ends exactly at the end of the file."""
    problems = []
    expected = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != expected:
            problems.append("%s: starts at data offset %d but the previous tensor ends at %d (%s)"
                            % (where(path, e.name), e.begin, expected,
                               "a hole" if e.begin > expected else "an overlap"))
        expected = max(expected, e.end)
    if expected != data_size:
        problems.append("%s: the tensors cover %d data bytes but the file holds %d after the "
                        "header (%s)" % (path, expected, data_size,
                                         "truncated" if expected > data_size
                                         else "bytes after the last tensor"))
    return problems


def check_metadata_object(path, root):
    """Rule: "__metadata__", if present, is an object mapping strings to strings."""
    if METADATA_KEY not in root:
        return []
    metadata = root[METADATA_KEY]
    if not isinstance(metadata, dict):
        return ["%s: __metadata__ is not an object" % path]
    return ["%s: __metadata__[%s] is not a string" % (path, quote(k))
            for k, v in metadata.items() if not isinstance(v, str)]


def check_data_start_alignment(path, data_start):
    """Rule (guaranteed by torchpoint's writer): the data starts at a multiple of 8."""
    if data_start % DATA_ALIGNMENT != 0:
        return ["%s: the data starts at byte %d, not a multiple of %d"
                % (path, data_start, DATA_ALIGNMENT)]
    return []


def check_tensor_alignment(path, entries, data_start):
    """Rule: every tensor's absolute offset is a multiple of its element size."""
    return ["%s: starts at file offset %d, not a multiple of its element size %d (%s)"
            % (where(path, e.name), data_start + e.begin, e.element_size, e.dtype)
            for e in entries if (data_start + e.begin) % e.element_size != 0]


# ---------------------------------------------------------------------------------------------
# torchpoint rules (format version 1.x)
# ---------------------------------------------------------------------------------------------

def check_checksum_tail(path, text):
    """Rule: the header text ends with '"torchpoint_header_xxh3":"<16 lowercase hex>"}}'
    followed only by spaces."""
    key = '"%s":"' % HEADER_CHECKSUM_KEY
    body = text.rstrip(" ")
    tail_length = len(key) + CHECKSUM_HEX_LENGTH + len('"}}')
    if len(body) < tail_length or body[-tail_length:][:len(key)] != key or not body.endswith('"}}'):
        return ["%s: the header does not end with '%s<16 hex>\"}}' before its padding"
                % (path, key)]
    digits = body[-CHECKSUM_HEX_LENGTH - 3:-3]
    if not is_checksum_hex(digits):
        return ["%s: the header checksum %s is not 16 lowercase hex digits"
                % (path, json.dumps(digits))]
    return []


def check_checksum_key_position(path, root):
    """Rule: __metadata__ is the header's last key and torchpoint_header_xxh3 is the last key
    of __metadata__."""
    problems = []
    if not root.key_order or root.key_order[-1] != METADATA_KEY:
        problems.append("%s: __metadata__ is not the last key of the header" % path)
    metadata = root.get(METADATA_KEY)
    if not isinstance(metadata, JsonObject):
        return problems
    if HEADER_CHECKSUM_KEY not in metadata:
        problems.append("%s: __metadata__ has no %s" % (path, quote(HEADER_CHECKSUM_KEY)))
        return problems
    if metadata.key_order[-1] != HEADER_CHECKSUM_KEY:
        problems.append("%s: %s is not the last key of __metadata__"
                        % (path, quote(HEADER_CHECKSUM_KEY)))
    # The form of its value (16 lowercase hex digits) is check_checksum_tail's to report.
    return problems


def parse_format_version(version):
    """(major, minor) for "MAJOR.MINOR" in canonical decimal (no sign, no leading zero)."""
    if not isinstance(version, str):
        return None
    parts = version.split(".")
    if len(parts) != 2:
        return None
    for p in parts:
        if not p or not all("0" <= c <= "9" for c in p) or (len(p) > 1 and p[0] == "0"):
            return None
    return int(parts[0]), int(parts[1])


def check_torchpoint_metadata(path, root, entries):
    """Rule: __metadata__["torchpoint"] is a JSON string of an object with "format":
    "torchpoint", "format_version" "1.x", "tensors" (name -> 16 lowercase hex, every tensor and
    only those) and "state" (an object).

    Returns (the parsed object or None, problems).
    """
    metadata = root.get(METADATA_KEY)
    if not isinstance(metadata, dict):
        return None, ["%s: the header has no __metadata__ object: not a torchpoint file" % path]
    text = metadata.get(TORCHPOINT_KEY)
    if not isinstance(text, str):
        return None, ["%s: __metadata__ has no string %s: not a torchpoint file"
                      % (path, quote(TORCHPOINT_KEY))]
    context = "%s: __metadata__[%s]" % (path, quote(TORCHPOINT_KEY))
    try:
        meta, end = parse_json_prefix(text)
    except (ValueError, RecursionError) as e:
        return None, ["%s is not valid JSON (%s)" % (context, e)]
    problems = []
    if text[end:]:
        problems.append("%s has text after its JSON value" % context)
    if not isinstance(meta, JsonObject):
        return None, problems + ["%s is not a JSON object" % context]
    problems += json_problems(meta, context)
    if meta.get("format") != FORMAT_NAME:
        problems.append("%s: \"format\" is %s, not \"%s\""
                        % (context, json.dumps(meta.get("format")), FORMAT_NAME))
    version = parse_format_version(meta.get("format_version"))
    if version is None:
        problems.append("%s: \"format_version\" %s is not \"MAJOR.MINOR\""
                        % (context, json.dumps(meta.get("format_version"))))
    elif version[0] != SUPPORTED_MAJOR:
        problems.append("%s: format version %s, but this checker reads version %d.x only"
                        % (context, meta["format_version"], SUPPORTED_MAJOR))
        return meta, problems  # another major version may lay everything out differently
    if "torchpoint_version" in meta and not isinstance(meta["torchpoint_version"], str):
        problems.append("%s: \"torchpoint_version\" is not a string" % context)
    if not isinstance(meta.get("state"), dict):
        problems.append("%s: \"state\" is missing or not an object" % context)
    pairs = meta.get("tensors")
    if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        problems.append("%s: \"tensors\" is missing or not a list of [name, checksum] pairs"
                        % context)
        return meta, problems
    tensors = {}
    for name, value in pairs:
        if name in tensors:
            problems.append("%s: listed twice in \"tensors\"" % where(path, name))
        tensors[name] = value
    names = {e.name for e in entries}
    for name, value in tensors.items():
        if name not in names:
            problems.append("%s: has a checksum in the torchpoint metadata's \"tensors\" but no "
                            "valid header entry" % where(path, name))
        elif not is_checksum_hex(value):
            problems.append("%s: checksum %s is not 16 lowercase hex digits"
                            % (where(path, name), json.dumps(value)))
    for e in entries:
        if e.name not in tensors:
            problems.append("%s: no checksum in the torchpoint metadata's \"tensors\""
                            % where(path, e.name))
    return meta, problems


def check_tensor_names(path, entries):
    """Rule (torchpoint writer): tensor names are not empty."""
    return ["%s: a tensor has an empty name" % path for e in entries if e.name == ""]


def check_writer_layout(path, root, entries, meta, data_start, data_size, padding):
    """Rule (torchpoint writer): data order is descending element size, ties in the order of
    "tensors"; header keys are in data order with __metadata__ last; the `padding` spaces at
    the end of the header are fewer than the alignment (8, or 4096 when O_DIRECT was used,
    which the writer does only for >= 1 MiB of data)."""
    problems = []
    pairs = meta.get("tensors") if isinstance(meta, dict) else None
    caller_order = [p[0] for p in pairs if isinstance(p, list) and p] \
        if isinstance(pairs, list) else None
    by_name = {e.name: e for e in entries}
    if caller_order is not None and set(caller_order) == set(by_name) \
            and len(caller_order) == len(by_name) \
            and len(entries) == len(root.key_order) - (METADATA_KEY in root):
        order = sorted(caller_order, key=lambda n: -by_name[n].element_size)  # stable
        offset = 0
        for name in order:
            e = by_name[name]
            if e.begin != offset:
                problems.append("%s: data_offsets begin at %d but the writer's order (descending "
                                "element size, then the order of \"tensors\") puts it at %d"
                                % (where(path, name), e.begin, offset))
                break
            offset = e.end
        header_order = [k for k in root.key_order if k != METADATA_KEY]
        if not problems and header_order != order:
            problems.append("%s: the header's tensor keys are not in data order" % path)
    direct = data_size >= DIRECT_MIN_DATA and data_start % DIRECT_ALIGNMENT == 0
    limit = DIRECT_ALIGNMENT if direct else DATA_ALIGNMENT
    if padding >= limit:
        problems.append("%s: the header ends with %d spaces of padding; the writer adds fewer "
                        "than %d" % (path, padding, limit))
    return problems


# ---------------------------------------------------------------------------------------------
# Values (--expect-json)
# ---------------------------------------------------------------------------------------------

def _f8_e4m3(byte):
    """float8 e4m3fn: bias 7, no infinities, S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0x0F
    mantissa = byte & 0x07
    if exponent == 0x0F and mantissa == 0x07:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa / 8.0, -6)
    return sign * math.ldexp(1.0 + mantissa / 8.0, exponent - 7)


def decode_values(dtype, raw):
    """The elements of `raw` (little-endian) as Python bool, int or float values."""
    size, fmt = DTYPES[dtype]
    count = len(raw) // size
    if fmt is not None:
        values = list(struct.unpack("<%d%s" % (count, fmt), raw))
        if dtype == "BOOL":
            return [v if v > 1 else bool(v) for v in values]  # a byte other than 0/1 stays an int
        return values
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % count, raw)
        return list(struct.unpack("<%df" % count, struct.pack("<%dI" % count,
                                                               *(h << 16 for h in halves))))
    if dtype == "F8_E5M2":
        return list(struct.unpack("<%de" % count, struct.pack("<%dH" % count,
                                                               *(b << 8 for b in raw))))
    if dtype == "F8_E4M3":
        return [_f8_e4m3(b) for b in raw]
    raise ValueError("no decoder for %s" % dtype)


_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "NaN": math.nan,
                   "Infinity": math.inf, "-Infinity": -math.inf}


def element_matches(dtype, actual, actual_bits, expected):
    """Whether one decoded element equals its expectation (see the module docstring)."""
    if isinstance(expected, str):
        if expected.startswith("0x"):
            try:
                return actual_bits == int(expected[2:], 16)
            except ValueError:
                return False
        if dtype in FLOAT_DTYPES and expected in _SPECIAL_FLOATS:
            expected = _SPECIAL_FLOATS[expected]
        else:
            return False
    if dtype == "BOOL":
        return isinstance(actual, bool) and (expected is actual or (is_json_int(expected) and
                                                                     expected == int(actual)
                                                                     and expected in (0, 1)))
    if dtype in INT_DTYPES:
        return is_json_int(expected) and expected == actual
    if isinstance(expected, bool) or not isinstance(expected, (int, float)):
        return False
    try:
        expected = float(expected)
    except OverflowError:
        return False
    if math.isnan(actual) and math.isnan(expected):
        return True
    return struct.pack("<d", actual) == struct.pack("<d", expected)


def check_tensor_values(path, entry, raw, expected):
    """Rule (--expect-json): dtype, shape and every element equal the expectation."""
    at = where(path, entry.name)
    if not isinstance(expected, dict):
        return ["%s: the expectation is not an object" % at]
    problems = []
    if expected.get("dtype") != entry.dtype:
        problems.append("%s: dtype %s, expected %s"
                        % (at, entry.dtype, json.dumps(expected.get("dtype"))))
    if expected.get("shape") != entry.shape:
        problems.append("%s: shape %s, expected %s"
                        % (at, json.dumps(entry.shape), json.dumps(expected.get("shape"))))
    values = expected.get("values")
    if not isinstance(values, list):
        return problems + ["%s: the expectation has no \"values\" list" % at]
    if len(values) != entry.numel:
        return problems + ["%s: holds %d elements, the expectation lists %d"
                           % (at, entry.numel, len(values))]
    actual = decode_values(entry.dtype, raw)
    size = entry.element_size
    mismatches = []
    for i, (a, x) in enumerate(zip(actual, values)):
        bits = int.from_bytes(raw[i * size:(i + 1) * size], "little")
        if not element_matches(entry.dtype, a, bits, x):
            mismatches.append((i, a, bits, x))
    for i, a, bits, x in mismatches[:MAX_MISMATCHES_SHOWN]:
        problems.append("%s: element %d is %r (bits 0x%0*x), expected %s"
                        % (at, i, a, 2 * size, bits, json.dumps(x)))
    if len(mismatches) > MAX_MISMATCHES_SHOWN:
        problems.append("%s: %d more elements differ" % (at, len(mismatches) - MAX_MISMATCHES_SHOWN))
    return problems


def check_expected_tensors(path, handle, data_start, entries, expected):
    """Every expected tensor is in the file with the expected values, and nothing else is."""
    if not isinstance(expected, dict):
        return ["%s: the expectation for this file is not an object" % path]
    problems = []
    by_name = {e.name: e for e in entries}
    for name in expected:
        if name not in by_name:
            problems.append("%s: expected but not in the file (or its entry is invalid)"
                            % where(path, name))
    for e in entries:
        if e.name not in expected:
            problems.append("%s: in the file but not in the expectation" % where(path, e.name))
            continue
        handle.seek(data_start + e.begin)
        raw = handle.read(e.end - e.begin)
        if len(raw) != e.end - e.begin:
            problems.append("%s: could read only %d of its %d bytes"
                            % (where(path, e.name), len(raw), e.end - e.begin))
            continue
        problems += check_tensor_values(path, e, raw, expected[e.name])
    return problems


# ---------------------------------------------------------------------------------------------
# Whole files
# ---------------------------------------------------------------------------------------------

def check_open_file(path, handle, file_size, expected=None):
    """Every rule, on an open binary file of `file_size` bytes. Returns the problems."""
    handle.seek(0)
    n, problems = check_header_length(path, handle.read(8), file_size)
    if n is None:
        return problems
    raw = handle.read(n)
    if len(raw) != n:
        return ["%s: could read only %d of the %d header bytes" % (path, len(raw), n)]
    text, problems = check_header_text(path, raw)
    if text is None:
        return problems
    data_start = 8 + n
    data_size = file_size - data_start
    problems += check_data_start_alignment(path, data_start)
    problems += check_checksum_tail(path, text)
    root, found = check_header_json(path, text)
    problems += found
    if root is None:
        return problems
    problems += check_metadata_object(path, root)
    entries, found = check_tensor_entries(path, root)
    problems += found
    problems += check_offsets_tile(path, entries, data_size)
    problems += check_tensor_alignment(path, entries, data_start)
    # torchpoint
    problems += check_tensor_names(path, entries)
    problems += check_checksum_key_position(path, root)
    meta, found = check_torchpoint_metadata(path, root, entries)
    problems += found
    if not problems:
        padding = len(text) - len(text.rstrip(" "))
        problems += check_writer_layout(path, root, entries, meta, data_start, data_size, padding)
    if expected is not None:
        problems += check_expected_tensors(path, handle, data_start, entries, expected)
    return problems


def check_file(path, expected=None):
    """Every rule on the file at `path`; `expected` is its part of --expect-json, if any."""
    try:
        with open(path, "rb") as handle:
            return check_open_file(path, handle, os.fstat(handle.fileno()).st_size, expected)
    except OSError as e:
        return ["%s: cannot be read (%s)" % (path, e.strerror or e)]


def match_expectations(files, expectations):
    """Maps each FILE argument to its expectation; returns (mapping, problems)."""
    mapping, problems, used = {}, [], set()
    by_abs = {}
    by_base = {}
    for key in expectations:
        by_abs.setdefault(os.path.abspath(key), key)
        by_base.setdefault(os.path.basename(key), []).append(key)
    for f in files:
        key = None
        if f in expectations:
            key = f
        elif os.path.abspath(f) in by_abs:
            key = by_abs[os.path.abspath(f)]
        elif len(by_base.get(os.path.basename(f), [])) == 1:
            key = by_base[os.path.basename(f)][0]
        if key is not None:
            mapping[f] = expectations[key]
            used.add(key)
    for key in expectations:
        if key not in used:
            problems.append("%s: has an expectation but was not checked (not among the FILE "
                            "arguments)" % key)
    return mapping, problems


USAGE = "usage: check_safetensors.py [--expect-json PATH] FILE [FILE...]"


def parse_args(argv):
    """Returns (files, expect_json_path or None), or (None, None) for --help; raises
    ValueError on a usage error."""
    files, expect = [], None
    i = 0
    options_done = False
    while i < len(argv):
        arg = argv[i]
        if not options_done and arg == "--":
            options_done = True
        elif not options_done and arg in ("-h", "--help"):
            return None, None
        elif not options_done and arg == "--expect-json":
            if i + 1 >= len(argv):
                raise ValueError("--expect-json needs a PATH")
            expect = argv[i + 1]
            i += 1
        elif not options_done and arg.startswith("--expect-json="):
            expect = arg[len("--expect-json="):]
        elif not options_done and arg.startswith("-") and arg != "-":
            raise ValueError("unknown option %s" % arg)
        else:
            files.append(arg)
        i += 1
    if not files:
        raise ValueError("no FILE given")
    return files, expect


def main(argv):
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        files, expect_path = parse_args(argv)
    except ValueError as e:
        print("check_safetensors: %s\n%s" % (e, USAGE), file=sys.stderr)
        return 2
    if files is None:
        print(__doc__)
        return 0
    all_problems = []
    mapping = {}
    if expect_path is not None:
        try:
            with open(expect_path, "r", encoding="utf-8") as f:
                expectations = json.load(f)
        except (OSError, ValueError) as e:
            print("check_safetensors: cannot read --expect-json %s: %s" % (expect_path, e),
                  file=sys.stderr)
            return 2
        if not isinstance(expectations, dict):
            print("check_safetensors: --expect-json %s is not a JSON object" % expect_path,
                  file=sys.stderr)
            return 2
        mapping, found = match_expectations(files, expectations)
        all_problems += found
        for p in found:
            print(p)
    failed = 0
    for path in files:
        problems = check_file(path, mapping.get(path))
        for p in problems:
            print(p)
        if problems:
            failed += 1
        all_problems += problems
    print("check_safetensors: %d file(s) checked, %d failed, %d problem(s)"
          % (len(files), failed, len(all_problems)))
    return 0 if not all_problems else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
