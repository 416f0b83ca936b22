"""The README's crash-and-resume loop is the one examples/accelerate_resume.cc runs, and it works.

1. The code between the "// [loop]" and "// [loop end]" markers of the example, joined, appears
   verbatim in README.md.
2. A run killed with SIGKILL right after the step that ends an epoch (so the resume has
   resume_step 0), then run again, trains on exactly the batches the uninterrupted run trained
   on after that checkpoint, and ends with the same weights, to the last printed digit.
"""
import os
import shutil
import signal
import subprocess
import sys

binary, source, readme, scratch = sys.argv[1:5]
problems = []

# 1. The snippet.
segments, inside = [], False
for line in open(source, encoding="utf-8"):
    marker = line.strip()
    if marker == "// [loop]":
        inside = True
    elif marker == "// [loop end]":
        inside = False
    elif inside:
        segments.append(line)
snippet = "".join(segments)
if not snippet.strip():
    problems.append("no [loop] markers in %s" % source)
elif snippet not in open(readme, encoding="utf-8").read():
    problems.append("README.md does not show the loop of %s verbatim; it should read:\n%s"
                    % (source, snippet))


def run(project, *extra):
    return subprocess.run([binary, project, *extra], capture_output=True, text=True, timeout=120)


# 2. Kill and resume.
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
whole = run(os.path.join(scratch, "whole"))
if whole.returncode != 0:
    problems.append("the uninterrupted run failed: %s" % whole.stderr)
lines = whole.stdout.splitlines()
per_epoch = 7  # 50 samples in batches of 8
kill_after = 2 * per_epoch  # a checkpoint at the last batch of epoch 1
killed = run(os.path.join(scratch, "killed"), "--kill-after-step", str(kill_after))
if killed.returncode != -signal.SIGKILL:
    problems.append("the run to be killed exited with %d: %s" % (killed.returncode, killed.stderr))
resumed = run(os.path.join(scratch, "killed"))
if resumed.returncode != 0:
    problems.append("the resumed run failed: %s" % resumed.stderr)
expected = [l for l in lines if l.startswith("batch ") and int(l.split()[1][:-1]) > kill_after]
got = [l for l in resumed.stdout.splitlines() if l.startswith("batch ")]
if got != expected:
    problems.append("the resumed run trained on other batches:\n%s\nexpected:\n%s"
                    % ("\n".join(got[:5]), "\n".join(expected[:5])))
if not lines or resumed.stdout.splitlines()[-1:] != lines[-1:]:
    problems.append("final weights differ: %s vs %s" % (resumed.stdout.splitlines()[-1:], lines[-1:]))

for p in problems:
    print(p)
print("accelerate_resume: %s (%d batches after the kill compared)"
      % ("FAILED" if problems else "ok", len(expected)))
sys.exit(1 if problems else 0)
