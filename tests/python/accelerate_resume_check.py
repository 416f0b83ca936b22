"""A README loop is the one an example runs, and it works.

Usage: accelerate_resume_check.py BINARY SOURCE README SCRATCH [KILL_STEPS]

1. The code between the "// [loop]" and "// [loop end]" markers of SOURCE, joined, appears
   verbatim in README.md.
2. For each step of KILL_STEPS (comma-separated; by default 14, right after the step that ends
   epoch 1, so examples/accelerate_resume.cc resumes with resume_step 0): a run killed with
   SIGKILL after that step's checkpoint, then run again, trains on exactly the batches the
   uninterrupted run trained on after it, and ends with the same weights, to the last printed
   digit.
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
kill_steps = [int(k) for k in (sys.argv[5] if len(sys.argv) > 5 else "14").split(",")]
compared = 0
for kill_after in kill_steps:
    project = os.path.join(scratch, "killed-%d" % kill_after)
    killed = run(project, "--kill-after-step", str(kill_after))
    if killed.returncode != -signal.SIGKILL:
        problems.append("the run to be killed at step %d exited with %d: %s"
                        % (kill_after, killed.returncode, killed.stderr))
    resumed = run(project)
    if resumed.returncode != 0:
        problems.append("the run resumed after step %d failed: %s" % (kill_after, resumed.stderr))
    expected = [l for l in lines if l.startswith("batch ") and int(l.split()[1][:-1]) > kill_after]
    got = [l for l in resumed.stdout.splitlines() if l.startswith("batch ")]
    if got != expected:
        problems.append("the run resumed after step %d trained on other batches:\n%s\nexpected:\n%s"
                        % (kill_after, "\n".join(got[:5]), "\n".join(expected[:5])))
    if not lines or resumed.stdout.splitlines()[-1:] != lines[-1:]:
        problems.append("after a kill at step %d, final weights differ: %s vs %s"
                        % (kill_after, resumed.stdout.splitlines()[-1:], lines[-1:]))
    compared += len(expected)

for p in problems:
    print(p)
print("%s: %s (%d batches after %d kills compared)"
      % (os.path.basename(binary), "FAILED" if problems else "ok", compared, len(kill_steps)))
sys.exit(1 if problems else 0)
