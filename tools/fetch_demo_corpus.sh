#!/usr/bin/env bash
# Fetch the English prose corpus for the embedded demo model (see tools/README.md).
#
#   tools/fetch_demo_corpus.sh [OUTDIR]        (default: build-demo/corpus, git-ignored)
#
# Debian package: r-cran-janeaustenr (section gnu-r) -- the full texts of Jane Austen's six
# completed novels (Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, Northanger
# Abbey, Persuasion), as prepared from Project Gutenberg by Julia Silge. The novels are in the
# public domain; the package is MIT-licensed (see OUTDIR/SOURCE.txt and the package's copyright
# file). About 4 MB of clean 19th-century English prose, ~730k words.
#
# The texts sit in R's lazy-load database (data/Rdata.rdb: a 4-byte big-endian length then a
# zlib stream per object, each an R XDR serialization of a character vector of lines); a small
# Python reader below decodes them, so R is not needed.
#
# Writes OUTDIR/corpus.txt: UTF-8, one paragraph per line, paragraphs separated by one blank line,
# novels separated by two blank lines; chapter/volume headings and title pages removed, _italic_
# markers stripped, whitespace normalised. Needs apt-get (run `apt-get update` once if the
# download fails), dpkg and python3 (standard library only). Needs no root beyond apt-get's.
set -euo pipefail

PKG=r-cran-janeaustenr
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/build-demo/corpus}"
PYTHON="${PYTHON:-python3}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$OUT"
rm -rf pkg ./*.deb
# apt-get download writes into the current directory; as root it warns that it cannot drop
# privileges to _apt for a root-owned folder, which is harmless.
apt-get download "$PKG" 2>&1 | grep -v "unsandboxed" || true
DEB="$(ls "$OUT"/${PKG}_*.deb 2>/dev/null | head -n 1)"
if [ -z "$DEB" ]; then
    echo "error: apt-get download $PKG failed (try: apt-get update)" >&2
    exit 1
fi
dpkg -x "$DEB" pkg
VERSION="$(dpkg-deb -f "$DEB" Version)"

"$PYTHON" - "$OUT/pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb" "$OUT/corpus.txt" <<'PYEOF'
import re, struct, sys, zlib


class RReader:
    """Minimal reader for R's XDR serialization (version 2/3), enough for character vectors."""

    def __init__(self, buf):
        self.b, self.p, self.refs = buf, 0, []

    def int(self):
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def item(self):
        flags = self.int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t in (254, 253, 252, 251, 247, 242, 241):  # NULL, global/base/empty env, missing, ...
            return None
        if t == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            v = ("sym", self.item())
            self.refs.append(v)
            return v
        if t in (2, 3, 5, 6, 17):  # pairlist-like
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            return ("pair", tag, self.item(), self.item(), attr)
        if t == 9:  # CHARSXP
            n = self.int()
            if n < 0:
                return None
            raw = self.b[self.p:self.p + n]
            self.p += n
            return raw.decode("latin-1" if (flags >> 12) & 4 else "utf-8", errors="replace")
        if t in (10, 13):
            n = self.int()
            v = struct.unpack_from(">%di" % n, self.b, self.p)
            self.p += 4 * n
        elif t == 14:
            n = self.int()
            v = struct.unpack_from(">%dd" % n, self.b, self.p)
            self.p += 8 * n
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            v = [self.item() for _ in range(self.int())]
        elif t == 238:  # ALTREP: info, state, attributes
            return ("altrep", self.item(), self.item(), self.item())
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        attr = self.item() if has_attr else None
        return ("vec", t, v, attr)


def unserialize(buf):
    assert buf[:2] == b"X\n", "not an XDR serialization"
    r = RReader(buf)
    r.p = 2
    version = r.int()
    r.int(), r.int()
    if version == 3:
        n = r.int()  # native encoding name (read first: r.p += r.int() would use the old r.p)
        r.p += n
    return r.item()


def objects(path):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
        n = struct.unpack_from(">I", data, pos)[0]
        d = zlib.decompressobj()
        out = d.decompress(data[pos + 4:])
        assert len(out) == n
        pos = len(data) - len(d.unused_data)
        yield unserialize(out)


HEADING = re.compile(r"^(chapter|volume|book)\s+([ivxlc]+|\d+|the\s+\w+)\.?$", re.I)


def clean_novel(lines):
    paras, cur = [], []
    for line in lines + [""]:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    # Drop the title page: everything before the first chapter heading.
    first = next(i for i, p in enumerate(paras) if HEADING.match(p))
    out = []
    for p in paras[first:]:
        if HEADING.match(p) or not re.search(r"[a-z]", p):  # headings, all-caps lines
            continue
        if p.lower() in ("finis", "the end"):
            continue
        p = re.sub(r"(?<!\w)_([^_]+)_(?!\w)", r"\1", p)  # _italics_
        p = p.replace("_", "")
        p = re.sub(r"\s+", " ", p).strip()
        out.append(p)
    return out


novels = []
for obj in objects(sys.argv[1]):
    if obj and obj[0] == "vec" and obj[1] == 16:
        lines = obj[2]
        novels.append((lines[0].strip().title(), clean_novel(lines)))
order = ["Sense And Sensibility", "Pride And Prejudice", "Mansfield Park", "Emma",
         "Northanger Abbey", "Persuasion"]
novels.sort(key=lambda t: order.index(t[0]) if t[0] in order else 99)
assert len(novels) == 6, [t[0] for t in novels]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    f.write("\n\n\n".join("\n\n".join(p) for _, p in novels) + "\n")
for title, p in novels:
    print(f"  {title}: {len(p)} paragraphs, {sum(len(x) for x in p) / 1e6:.2f} M chars")
PYEOF

cat > "$OUT/SOURCE.txt" <<EOF
corpus.txt was produced by tools/fetch_demo_corpus.sh from the Debian package
  $PKG $VERSION ($(basename "$DEB"))
Content: Jane Austen's six completed novels (public domain; texts from Project Gutenberg,
packaged for R by Julia Silge). Package license: MIT (Files: * Copyright 2016-2017 Julia Silge;
debian/* Copyright 2021 Andreas Tille), see pkg/usr/share/doc/$PKG/copyright.
EOF
BYTES=$(wc -c < "$OUT/corpus.txt")
WORDS=$(wc -w < "$OUT/corpus.txt")
echo "wrote $OUT/corpus.txt ($BYTES bytes, $WORDS words) from $PKG $VERSION"
