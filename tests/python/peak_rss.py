"""Runs a command and prints its peak resident memory in bytes (then exits with its status).

A process started by a large one (a test binary holding big tensors) inherits that process's
peak in its own ru_maxrss when it is created by vfork, as posix_spawn does; started from this
small interpreter, the command's figure is its own.
"""
import resource
import subprocess
import sys

completed = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)  # Linux reports KiB
sys.exit(completed.returncode)
