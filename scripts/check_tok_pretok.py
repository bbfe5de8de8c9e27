#!/usr/bin/env python3
"""Cross-checks the hand-written pre-tokenizer splitters (common/tok_pretok.c)
against Python's re running the same GPT-2 and Llama-3 regexes, with \\p{L},
\\p{N} and \\s spelled out as classes from common/unicode_tables.inc.  Builds a
small driver with cc; needs only the standard library.

    python3 scripts/check_tok_pretok.py [n_strings] [seed]
"""
import os
import random
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = r'''
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "common/tok_pretok.h"
int main(int argc, char **argv) {
    static char buf[1 << 24];
    size_t n = fread(buf, 1, sizeof buf - 1, stdin), pos = 0;
    while (pos < n) {
        size_t len = strlen(buf + pos), s = 0;
        struct tok_pieces p = {0};
        if (tok_pretok_split(atoi(argv[1]), buf + pos, len, &p)) printf("ERR");
        for (size_t i = 0; i < p.n; i++) { printf("%u ", (unsigned)(p.end[i] - s)); s = p.end[i]; }
        printf("\n");
        tok_pieces_free(&p);
        pos += len + 1;
    }
    return 0;
}
'''


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    random.seed(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    src = open(os.path.join(ROOT, 'common/unicode_tables.inc')).read()
    ranges = [(int(a, 16), int(b, 16), int(f)) for a, b, f in
              re.findall(r'\{0x([0-9A-F]+), 0x([0-9A-F]+), (\d)\}', src)]

    def cls(flag):
        return ''.join('\\U%08x-\\U%08x' % (a, b) for a, b, f in ranges if f & flag)
    L, N, S = cls(1), cls(2), cls(4)
    letter, number, space, not_space = '[%s]' % L, '[%s]' % N, '[%s]' % S, '[^%s]' % S
    other = '[^%s%s%s]' % (S, L, N)
    gpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?%s+| ?%s+| ?%s+|%s+(?!%s)|%s+" % (
        letter, number, other, space, not_space, space)
    llama3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n%s%s]?%s+|%s{1,3}| ?%s+[\\r\\n]*|%s*[\\r\\n]+|%s+(?!%s)|%s+"
              % (L, N, letter, number, other, space, space, not_space, space))
    patterns = {1: re.compile(gpt2), 2: re.compile(llama3)}  # enum tok_pretok_kind values
    alphabet = list("aZ\u00e9'sStTrReEvVmMlLdD ") + [
        '\n', '\r', '\t', ' ', ' ', '\u3000', '\u00a0', '1', '\u0663', '\u00bd', '!', '.', '$',
        '\U0001f999', '\u0301', '\u17b6', '\u1780', '\u4e2d', '\x0b', "'", "'"]
    texts = [''.join(random.choice(alphabet) for _ in range(random.randint(1, 24))) for _ in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        drv = os.path.join(tmp, 'drv')
        with open(drv + '.c', 'w') as f:
            f.write(DRIVER)
        subprocess.run(['cc', '-O1', '-D_GNU_SOURCE', '-I' + ROOT, '-I' + os.path.join(ROOT, 'common'),
                        drv + '.c', os.path.join(ROOT, 'common/tok_pretok.c'),
                        os.path.join(ROOT, 'common/unicode.c'), '-o', drv], check=True)
        bad = 0
        for kind, pat in patterns.items():
            data = b''.join(t.encode() + b'\0' for t in texts)
            out = subprocess.run([drv, str(kind)], input=data, capture_output=True, check=True).stdout
            for text, line in zip(texts, out.decode().split('\n')):
                want = [len(m.group(0).encode()) for m in pat.finditer(text)]
                got = [int(x) for x in line.split()]
                if want != got:
                    bad += 1
                    if bad <= 10:
                        print('kind %d %r: want %s got %s' % (kind, text, want, got))
            print('kind %d: %d strings checked' % (kind, len(texts)))
    print('mismatches: %d' % bad)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
