"""Runs a fitting program on a pseudo-terminal of a given width and checks what it drew.

Usage: progress_pty.py PROGRAM COLUMNS

The terminal is real (pty.fork with TIOCSWINSZ), so the program finds it as a user's would.
Checks: every state of the bar (each piece between carriage returns and newlines, control
sequences removed) fits in COLUMNS - 1; the training bar shows batches, elapsed<ETA, a rate and
the loss; a validation bar is drawn; each epoch ends with its summary line. Prints what it saw
and exits non-zero on the first failed check.
"""
import fcntl
import os
import pty
import re
import struct
import sys
import termios


def run_on_pty(program, columns):
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(program, [program])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks).decode(), os.waitstatus_to_exitcode(status)


def main():
    program, columns = sys.argv[1], int(sys.argv[2])
    text, code = run_on_pty(program, columns)
    assert code == 0, f"the program exited with {code}:\n{text}"
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    pieces = [p for p in re.split(r"[\r\n]+", plain) if p]
    bars = [p for p in pieces if "/" in p and "[" in p]
    train = [p for p in bars if "valid" not in p]
    valid = [p for p in bars if "valid" in p]
    summaries = [p for p in pieces if re.match(r"Epoch \d/2 train_loss: ", p)]
    for p in pieces:
        if p.startswith("Epoch") and p not in summaries:
            assert len(p) <= columns - 1, f"{len(p)} columns on a {columns}-column terminal: {p!r}"
    assert train, f"no training bar drawn:\n{plain}"
    assert valid, f"no validation bar drawn:\n{plain}"
    bar_shape = r"Epoch \d/2( valid)? \[[=> ]+\] \d+/\d+ \d+:\d\d<(\d+:\d\d|\?) [0-9.?]+ (batch/s|s/batch)"
    for p in train + valid:
        assert re.match(bar_shape, p), f"not a bar: {p!r}"
    assert any(re.search(r"10/10 .* batch/s loss: \d+\.\d{4}$", p) for p in train), train
    assert any(re.search(r"5/5 ", p) for p in valid), valid
    assert len(summaries) == 2, f"want 2 epoch summaries, got {summaries}"
    print(f"{columns} columns: {len(train)} training and {len(valid)} validation bars, "
          f"widest {max(len(p) for p in train + valid)}; last: {train[-1]!r}")


main()
