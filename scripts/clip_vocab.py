"""Convert CLIP's BPE file (``bpe_simple_vocab_16e6.txt.gz``, shipped in open_clip's wheel) into
the ``vocab.json`` + ``merges.txt`` pair transformers' ``CLIPTokenizer`` reads.

    python scripts/clip_vocab.py /tmp/oc/bpe_simple_vocab_16e6.txt.gz OUT_DIR

The vocabulary is built as CLIP's own tokenizer builds it: the 256 byte characters, the same
with ``</w>``, one token per merge (the first 48,894 merges), then ``<|startoftext|>`` and
``<|endoftext|>``: 49,408 tokens, ids identical to ``openai/clip-vit-large-patch14``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from maxdiff.tokenizers import bytes_to_unicode

N_MERGES = 49152 - 256 - 2


def convert(gz_path: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``vocab.json`` and ``merges.txt`` into ``out_dir``; returns their paths."""
    lines = gzip.open(gz_path, "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(m.split()) for m in lines[1:1 + N_MERGES]]
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != 49408:
        raise ValueError(f"{gz_path}: built {len(vocab)} tokens, expected 49408 (not CLIP's BPE file?)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vp, mp = out / "vocab.json", out / "merges.txt"
    vp.write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    mp.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
    return vp, mp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bpe_gz", help="path to bpe_simple_vocab_16e6.txt.gz")
    ap.add_argument("out_dir", help="folder to write vocab.json and merges.txt into")
    a = ap.parse_args()
    for p in convert(a.bpe_gz, a.out_dir):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
