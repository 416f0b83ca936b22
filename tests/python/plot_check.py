#!/usr/bin/python3
"""Checks a picture written by torchpoint's render_records (records_plot.h).

Usage:
    plot_check.py PLOT.png WIDTH HEIGHT [--colors N]
    plot_check.py PLOT.svg

A PNG is decoded with zlib and numpy only (no imaging library): every chunk's CRC, an IHDR
of 8-bit RGB or RGBA without interlacing, IDAT rows under each of the five PNG filters, IEND
last. Then the picture must be WIDTH x HEIGHT with a white background (its most common
colour) and show
  - the title: at least 30 non-background pixels in the top 30 rows;
  - tick labels: at least 30 non-background pixels left of the first panel's frame (the
    leftmost column holding a vertical line of 100 or more pixels of one colour), not counting
    the 5 columns of tick marks next to it, below the title;
  - with --colors N: curves and legend in N distinct saturated colours (a channel spread of
    100 or more). A colour counts when it is on at least 20 pixels and at least a quarter as
    many as the most used one: a curve's own colour is on hundreds of pixels, each of its
    anti-aliased shades on a few dozen at most.

Prints "ok: ..." and exits 0 when all hold; prints one line per problem and exits 1
otherwise, 2 on a usage error.

An SVG is parsed with xml.etree. Its root must be an SVG <svg> element whose first child is
<title> and whose <metadata> holds the <plot> element of records_plot.h, with the same size
as the <svg> element (its width and height in px) and the same title. Prints, and exits 0:
    svg WIDTHxHEIGHT panels=P columns=C title='TITLE'
    series set='SET' metric='METRIC' values=V points=P runs=R     (one line per series)
with the texts as Python's repr() writes them; on a problem, prints it and exits 1.
"""

import struct
import sys
import xml.etree.ElementTree as ElementTree
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def chunks(data, problems):
    """The (type, body) chunks of a PNG file, their CRCs checked."""
    if data[:8] != SIGNATURE:
        problems.append("not a PNG: the first 8 bytes are %r" % data[:8])
        return []
    out = []
    at = 8
    while at + 12 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        if zlib.crc32(kind + body) != crc:
            problems.append("chunk %r at byte %d: CRC mismatch" % (kind, at))
        out.append((kind, body))
        at += 12 + length
    if at != len(data):
        problems.append("%d bytes after the last whole chunk" % (len(data) - at))
    return out


def unfilter(raw, width, height, channels):
    """The pixels of the decompressed IDAT stream, as a height x width x channels array."""
    stride = width * channels
    if len(raw) != height * (stride + 1):
        raise ValueError("IDAT holds %d bytes, not %d" % (len(raw), height * (stride + 1)))
    rows = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: each byte adds the one a pixel to its left, a running sum
            row = np.cumsum(line.reshape(width, channels), axis=0).reshape(stride) % 256
        elif kind == 2:  # Up
            row = (line + previous) % 256
        elif kind in (3, 4):  # Average, Paeth: each byte depends on the one just decoded
            row = bytearray(stride)
            up = previous.tolist()
            values = line.tolist()
            for i in range(stride):
                left = row[i - channels] if i >= channels else 0
                if kind == 3:
                    predicted = (left + up[i]) // 2
                else:
                    upper_left = up[i - channels] if i >= channels else 0
                    p = left + up[i] - upper_left
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upper_left)
                    predicted = left if pa <= pb and pa <= pc else up[i] if pb <= pc else upper_left
                row[i] = (values[i] + predicted) % 256
            row = np.frombuffer(bytes(row), np.uint8).astype(np.int32)
        else:
            raise ValueError("row %d has filter type %d" % (y, kind))
        rows[y] = row
        previous = row.astype(np.int32)
    return rows.reshape(height, width, channels)


def frame_column(ink):
    """The leftmost column with a vertical run of 100 or more pixels of one colour, or None."""
    height, width = ink.shape[:2]
    for x in range(width):
        column = ink[:, x]
        run = 1
        for y in range(1, height):
            same = column[y] != 0 and column[y] == column[y - 1]
            run = run + 1 if same else 1
            if run >= 100:
                return x
    return None


SVG = "{http://www.w3.org/2000/svg}"
PLOT = "{urn:torchpoint:records-plot}"


def check_svg(path):
    """The SVG checks of the module docstring; returns the exit status."""
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as e:
        print("not XML: %s" % e)
        return 1
    if root.tag != SVG + "svg":
        print("the root element is %s, not an SVG <svg>" % root.tag)
        return 1
    children = list(root)
    plot = root.find(SVG + "metadata/" + PLOT + "plot")
    if not children or children[0].tag != SVG + "title" or plot is None:
        print("<svg> does not start with <title> and hold <metadata><plot>")
        return 1
    width, height = plot.get("width"), plot.get("height")
    problems = []
    if (root.get("width"), root.get("height")) != (width + "px", height + "px"):
        problems.append(
            "<svg> is %sx%s, its metadata says %sx%s"
            % (root.get("width"), root.get("height"), width, height)
        )
    if (children[0].text or "") != plot.get("title"):
        problems.append("<title> %r, metadata title %r" % (children[0].text, plot.get("title")))
    if problems:
        print("\n".join(problems))
        return 1
    print(
        "svg %sx%s panels=%s columns=%s title=%r"
        % (width, height, plot.get("panels"), plot.get("columns"), plot.get("title"))
    )
    for series in plot.iter(PLOT + "series"):
        print(
            "series set=%r metric=%r values=%s points=%s runs=%s"
            % tuple(series.get(k) for k in ("data-set", "data-metric", "values", "points", "runs"))
        )
    return 0


def main(argv):
    args = argv[1:]
    if len(args) == 1 and args[0].lower().endswith(".svg"):
        return check_svg(args[0])
    colors = None
    if "--colors" in args:
        at = args.index("--colors")
        colors = int(args[at + 1])
        del args[at : at + 2]
    if len(args) != 3:
        print(__doc__)
        return 2
    path, width, height = args[0], int(args[1]), int(args[2])
    problems = []
    with open(path, "rb") as f:
        parsed = chunks(f.read(), problems)
    if not parsed:
        problems.append("no chunks")
    elif parsed[0][0] != b"IHDR" or parsed[-1][0] != b"IEND":
        problems.append("chunks %s: IHDR must come first and IEND last" % [k for k, _ in parsed])
    if problems:
        print("\n".join(problems))
        return 1
    w, h, depth, color_type, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", parsed[0][1]
    )
    if depth != 8 or color_type not in (2, 6) or (compression, filtering, interlace) != (0, 0, 0):
        print(
            "IHDR: depth %d, colour type %d, compression %d, filter %d, interlace %d; expected "
            "8-bit RGB (2) or RGBA (6) without interlacing"
            % (depth, color_type, compression, filtering, interlace)
        )
        return 1
    channels = 3 if color_type == 2 else 4
    try:
        raw = zlib.decompress(b"".join(body for kind, body in parsed if kind == b"IDAT"))
        pixels = unfilter(raw, w, h, channels)[:, :, :3].astype(np.int32)
    except (zlib.error, ValueError) as e:
        print("pixel data: %s" % e)
        return 1
    if (w, h) != (width, height):
        problems.append("the picture is %dx%d, expected %dx%d" % (w, h, width, height))

    # Each pixel as one integer 0xRRGGBB; "ink" is every pixel that is not background.
    packed = (pixels[:, :, 0] << 16) | (pixels[:, :, 1] << 8) | pixels[:, :, 2]
    values, counts = np.unique(packed, return_counts=True)
    background = int(values[np.argmax(counts)])
    if background != 0xFFFFFF:
        problems.append("the background is #%06x, not white" % background)
    ink = np.where(packed != background, packed + 1, 0)  # +1: black ink is not 0

    title = int(np.count_nonzero(ink[:30]))
    if title < 30:
        problems.append("the title strip (top 30 rows) has %d non-background pixels" % title)
    frame = frame_column(ink)
    labels = 0
    if frame is None:
        problems.append("no panel frame: no vertical line of 100 pixels")
    else:
        labels = int(np.count_nonzero(ink[30:, : max(0, frame - 5)]))
        if labels < 30:
            problems.append(
                "left of the frame at x=%d (the y tick labels) there are %d non-background "
                "pixels" % (frame, labels)
            )
    spread = pixels.max(axis=2) - pixels.min(axis=2)
    _, vivid_counts = np.unique(packed[spread >= 100], return_counts=True)
    most = int(vivid_counts.max()) if vivid_counts.size else 0
    curve_colors = int(np.count_nonzero(vivid_counts >= max(20, most / 4)))
    if colors is not None and curve_colors != colors:
        problems.append("%d curve colours, expected %d" % (curve_colors, colors))

    if problems:
        print("\n".join(problems))
        return 1
    print(
        "ok: %dx%d %s, title %d px, tick labels %d px, %d curve colours"
        % (w, h, "RGB" if channels == 3 else "RGBA", title, labels, curve_colors)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
