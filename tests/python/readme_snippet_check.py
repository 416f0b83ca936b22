"""The code between "// [NAME]" and "// [NAME end]" in SOURCE appears in README, dedented.

Usage: readme_snippet_check.py SOURCE README NAME
"""
import sys
import textwrap

source, readme, name = sys.argv[1:4]
text = open(source, encoding="utf-8").read()
begin, end = "// [%s]\n" % name, "// [%s end]\n" % name
if begin not in text or end not in text:
    sys.exit("FAILED: %s has no %s ... %s markers" % (source, begin.strip(), end.strip()))
body = text.split(begin, 1)[1].split(end, 1)[0]
body = body[:body.rfind("\n") + 1] if not body.endswith("\n") else body
lines = body.split("\n")
# The markers are indented like the code; drop the indentation of the first marker's line.
snippet = textwrap.dedent("".join(line + "\n" for line in lines if line is not None)).rstrip() + "\n"
snippet = "\n".join(l.rstrip() for l in snippet.split("\n"))
if snippet.strip() not in open(readme, encoding="utf-8").read():
    sys.exit("FAILED: README.md does not show the code of %s verbatim; it should read:\n%s"
             % (source, snippet))
print("ok: README.md shows the [%s] code of %s" % (name, source))
