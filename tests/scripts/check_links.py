#!/usr/bin/env python3
"""docs.links: every relative link of README.md and docs/*.md resolves.

A link's file (or folder) must exist, inside the repository; a link's #anchor
must be a heading of the page it points to, as GitHub spells the anchor:
the heading's text lowercased, every character but letters, digits, spaces,
'-' and '_' dropped, spaces turned into '-', and a repeated anchor suffixed
-1, -2, ... An anchor into a file that is not a page (x.cpp#L10) must name
lines the file has. Links in fenced blocks and code spans are not links.

    python3 check_links.py <repo>

Prints one line per broken link (page:line: the link, and what is missing)
and exits 1; prints how many links it checked and exits 0 otherwise.

    python3 check_links.py --doxygen-filter <repo> <page>

is Doxygen's input filter for the pages (cmake/dtrain_docs.cmake): the same
anchors, spelled so that the links work in the API reference's HTML too.
"""
import os
import re
import sys

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")
HTML_TARGET = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ *(```|~~~)")
EXPLICIT_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)=\"([^\"]+)\"")


def prose_lines(path):
    """(number, line) of the lines outside fenced blocks."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence = None
    for number, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1) == fence:
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield number, line


def text_lines(path):
    """prose_lines() with code spans blanked (the same length: columns stay)."""
    for number, line in prose_lines(path):
        yield number, re.sub(r"(`+)(.+?)\1", lambda c: " " * len(c.group(0)), line)


def prose_text(path):
    """The page with fenced blocks and code spans blanked, every other
    character where it was: offsets into it are offsets into the page. A
    link's text may wrap onto the next line, so links are found in this whole
    text, not line by line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    prose = dict(text_lines(path))
    return "\n".join(prose.get(n, " " * len(line)) for n, line in enumerate(lines, 1))


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def github_anchor(heading):
    """The anchor GitHub gives a heading's text (before the -1, -2 of repeats)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)                  # code spans: their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)       # links: their text
    text = re.sub(r"<[^>]+>", "", text)                          # HTML tags
    text = re.sub(r"(\*\*|__|\*|_(?=\W|$)|(?<=\W)_)", "", text)  # emphasis
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchors = {}


def anchors(path):
    """Every anchor of a page: its headings' (with repeats numbered) and <a name/id>."""
    if path not in _anchors:
        found, seen = set(), {}
        for _, line in prose_lines(path):
            found.update(EXPLICIT_ANCHOR.findall(line))
            h = HEADING.match(line)
            if h:
                base = github_anchor(h.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        _anchors[path] = found
    return _anchors[path]


def check(root, page):
    """The problems of one page's links, and how many links it has."""
    problems, count = [], 0
    name = os.path.relpath(page, root)
    text = prose_text(page)
    found = [(line_of(text, m.start(1)), m.group(1)) for m in LINK.finditer(text)]
    for number, line in text_lines(page):
        found += [(number, m.group(1)) for m in REFERENCE.finditer(line)]
        found += [(number, t) for t in HTML_TARGET.findall(line)]
    for number, target in sorted(found, key=lambda f: f[0]):
        target = target.strip("<>")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        count += 1
        where = f"{name}:{number}: ({target})"
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if os.path.relpath(file, root).startswith(".."):
            problems.append(f"{where}: {path} is outside the repository")
            continue
        if not os.path.exists(file):
            problems.append(f"{where}: no file {os.path.relpath(file, root)}")
            continue
        if not anchor:
            continue
        if file.endswith(".md"):
            if anchor not in anchors(file):
                near = sorted(a for a in anchors(file) if a[:6] == anchor[:6])
                hint = f" (near: {', '.join('#' + a for a in near)})" if near else ""
                problems.append(f"{where}: no heading #{anchor} in {os.path.relpath(file, root)}{hint}")
        elif os.path.isfile(file):
            lines = re.fullmatch(r"L(\d+)(?:-L(\d+))?", anchor)
            with open(file, encoding="utf-8", errors="replace") as f:
                length = len(f.read().splitlines())
            if not lines:
                problems.append(f"{where}: #{anchor} is not a line anchor (#L12, #L12-L20) of a file")
            elif max(int(x) for x in lines.groups() if x) > length:
                problems.append(f"{where}: {os.path.relpath(file, root)} has {length} lines")
        else:
            problems.append(f"{where}: #{anchor} on a folder")
    return problems, count


def doxygen_labels(root, file):
    """{line number: (heading level, text, label)} of a page's headings that
    Doxygen can label, and {GitHub anchor: label or None} of all of them: not
    the title (its page is the link), nor a subsection outside a section
    (Doxygen refuses the label there)."""
    page = re.sub(r"[^A-Za-z0-9_]", "_", os.path.splitext(os.path.relpath(file, root))[0])
    headings, labels, seen, open_levels = {}, {}, {}, set()
    for number, line in prose_lines(file):
        h = HEADING.match(line)
        if not h:
            continue
        level, base = len(h.group(1)), github_anchor(h.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchor = base if n == 0 else f"{base}-{n}"
        open_levels = {l for l in open_levels if l < level} | {level}
        if level == 1 or (level > 2 and level - 1 not in open_levels):
            labels[anchor] = None
            continue
        labels[anchor] = f"{page}-{anchor}"
        headings[number] = (h.group(1), h.group(2), labels[anchor])
    return headings, labels


def doxygen_filter(root, page):
    """Prints the page as Doxygen (1.9, whose anchors are not GitHub's) should
    read it: each heading labelled {#label} after its GitHub anchor, and each
    link to such an anchor made a [text](@ref label) (or a link to the page,
    where Doxygen cannot label the heading), its text on one line. Lines
    stay where they are (but for those of a paragraph after a wrapped link's
    end), so that doxygen's warnings name the page's lines."""
    with open(page, encoding="utf-8") as f:
        page_text = f.read()
    headings, _ = doxygen_labels(root, page)
    prose = prose_text(page)  # outside fences, code spans blanked
    for m in reversed(list(LINK.finditer(prose))):
        if line_of(prose, m.start()) in headings:
            continue
        path, _, anchor = m.group(1).strip("<>").partition("#")
        if not anchor or re.match(r"^[a-z][a-z0-9+.-]*:", path, re.I):
            continue
        file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not file.endswith(".md") or not os.path.exists(file):
            continue
        label = doxygen_labels(root, file)[1].get(anchor)
        target = "@ref " + label if label else path or os.path.basename(page)
        # Doxygen 1.9 misreads a link whose text wraps: the text goes on one
        # line, and its line breaks to the end of the paragraph (the lines
        # after the paragraph stay in place).
        text = page_text[m.start():m.start(1)]
        breaks = text.count("\n")
        link = text.replace("\n", " ") + target + page_text[m.end(1):m.end()]
        end = page_text.find("\n\n", m.end())
        end = len(page_text) if end == -1 else end
        page_text = (page_text[:m.start()] + link + page_text[m.end():end] + "\n" * breaks +
                     page_text[end:])
    lines = page_text.split("\n")
    for number, (hashes, text, label) in headings.items():
        lines[number - 1] = f"{hashes} {text} {{#{label}}}"
    sys.stdout.write("\n".join(lines))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--doxygen-filter":
        doxygen_filter(os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3]))
        return 0
    if len(sys.argv) != 2:
        sys.exit("usage: check_links.py <repo> | check_links.py --doxygen-filter <repo> <page>")
    root = os.path.abspath(sys.argv[1])
    pages = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        pages += sorted(os.path.join(docs, p) for p in os.listdir(docs) if p.endswith(".md"))
    problems, count = [], 0
    for page in pages:
        if os.path.exists(page):
            p, n = check(root, page)
            problems += p
            count += n
    for problem in problems:
        print(problem)
    if problems:
        print(f"docs.links: {len(problems)} of {count} links are broken")
        return 1
    print(f"docs.links: {count} relative links in {len(pages)} pages resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
