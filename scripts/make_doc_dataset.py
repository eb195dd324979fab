#!/usr/bin/env python
"""Write a small Megatron indexed dataset (PREFIX.bin + PREFIX.idx) of documents of mixed lengths,
each ending with the tokenizer's end-of-document (EOD) token -- data for ``--data-path PREFIX``
with ``--reset-attention-mask`` (documents cut at EOD tokens) or ``--cp-thd-packing`` (packed
sequences) in the plugin's entry script.

Documents a small model learns from (``--content repeat``, the default): every document draws its
tokens from a small subset of the vocabulary (``--vocab-subset`` ids, the same for all
documents), and repeats one span of its own (``--period`` tokens, drawn per document) until it
ends. A 2-layer model's loss falls within a few iterations -- first by learning the subset (no
attention needed), then by copying the token ``--period`` back, which only attention inside the
document gets right (the span differs from document to document, so attention across a boundary
does not help). ``--content random`` writes uniform random tokens in [0, EOD) instead, which no
model learns (the loss stays at log(vocab)).

Document lengths (EOD included) are lognormal with the given mean, rounded and clipped to
[1, --max-length]; a --one-token-fraction of the documents are a lone EOD token. With the
defaults (mean 12, sigma 1) at --seq-length 64 and CP 4 (chunks of 16 tokens, halves of 8) a
sample holds ~5 documents: about 1 in 5 is longer than a chunk, some span several samples, and
about 1 in 12 is a single token. The EOD id is NullTokenizer's, ``--vocab-size - 1``.

    .venv/bin/python scripts/make_doc_dataset.py data/tiny_docs   # what configs/gpt_tiny_cpu_docs.yaml reads
    scripts/make_doc_dataset.py /tmp/docs --mean-length 200 --max-length 4096 --documents 500

It writes with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` (the format of
Megatron-LM's ``tools/preprocess_data.py``), so Megatron's GPTDataset reads it unchanged; the
same arguments always write the same files.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np


def document_lengths(documents: int, mean: float, sigma: float, max_length: int, one_token_fraction: float,
                     seed: int) -> np.ndarray:
    """Lengths (EOD included) of ``documents`` documents: lognormal with mean ``mean``, rounded
    and clipped to [1, max_length]; a ``one_token_fraction`` of them set to 1."""
    for name, value, low in (("--documents", documents, 1), ("--mean-length", mean, 1), ("--max-length", max_length, 1)):
        if not value >= low or not math.isfinite(value):  # nan compares False either way
            raise ValueError(f"{name} must be a finite number >= {low}, got {value}")
    if not 0 <= sigma < math.inf:
        raise ValueError(f"--sigma must be a finite number >= 0, got {sigma}")
    if not 0 <= one_token_fraction <= 1:
        raise ValueError(f"--one-token-fraction must be in [0, 1], got {one_token_fraction}")
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # E[lognormal(mu, sigma)] = mean
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, documents)), 1, max_length).astype(np.int64)
    lengths[rng.random(documents) < one_token_fraction] = 1
    return lengths


CONTENTS = ("repeat", "random")


def document_tokens(lengths, eod: int, seed: int, content: str = "repeat", vocab_subset: int = 16,
                    period: int = 8):
    """The documents' tokens, one int64 array per length ending with ``eod``: ``repeat`` -- one
    span of ``period`` tokens drawn (per document) from a fixed subset of ``vocab_subset`` ids of
    [0, eod), repeated to the document's length; ``random`` -- uniform tokens in [0, eod)."""
    if content not in CONTENTS:
        raise ValueError(f"--content {content!r}: allowed {', '.join(CONTENTS)}")
    if content == "repeat":
        if not 1 <= vocab_subset <= eod:
            raise ValueError(f"--vocab-subset must be in [1, EOD id {eod}] (ids below the EOD), got {vocab_subset}")
        if period < 1:
            raise ValueError(f"--period must be >= 1, got {period}")
    rng = np.random.default_rng(seed + 1)
    subset = np.sort(rng.choice(eod, vocab_subset, replace=False)) if content == "repeat" else None
    for n in lengths:
        if content == "random":
            body = rng.integers(0, eod, int(n) - 1)
        else:
            body = np.resize(rng.choice(subset, period), int(n) - 1)  # the span, again and again
        yield np.concatenate([body, [eod]]).astype(np.int64)


def write_dataset(prefix: str, lengths, vocab_size: int, eod: int, seed: int, content: str = "repeat",
                  vocab_subset: int = 16, period: int = 8) -> dict:
    """Write PREFIX.bin / PREFIX.idx: one document per length (see :func:`document_tokens`),
    each ending with ``eod``. Returns a summary (documents, tokens, dtype)."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not 0 < eod < vocab_size:
        raise ValueError(f"--eod-id {eod} must be in [1, --vocab-size {vocab_size})")
    if not os.path.basename(prefix):  # "data/" would write data/.bin and data/.idx, hidden files
        raise ValueError(f"prefix {prefix!r} names a folder: give PREFIX, the files are PREFIX.bin and PREFIX.idx "
                         f"(e.g. {os.path.join(prefix, 'tiny_docs')})")
    docs = document_tokens(lengths, eod, seed, content, vocab_subset, period)
    first = next(docs, None)  # the checks of the options run before any file is written
    if os.path.dirname(prefix):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in ([] if first is None else [first]) + list(docs):
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return dict(documents=len(lengths), tokens=int(np.sum(lengths)), dtype=np.dtype(dtype).name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="output path prefix: writes PREFIX.bin and PREFIX.idx (for --data-path PREFIX)")
    ap.add_argument("--documents", type=int, default=2000, help="number of documents (default 2000)")
    ap.add_argument("--mean-length", type=float, default=12.0, help="mean document length in tokens (default 12)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths (default 1.0)")
    ap.add_argument("--max-length", type=int, default=256, help="longest document (default 256)")
    ap.add_argument("--one-token-fraction", type=float, default=0.05,
                    help="share of documents that are a lone EOD token (default 0.05)")
    ap.add_argument("--vocab-size", type=int, default=128, help="Megatron's --vocab-size (default 128)")
    ap.add_argument("--eod-id", type=int, default=None,
                    help="end-of-document id (default --vocab-size - 1, NullTokenizer's)")
    ap.add_argument("--content", default="repeat", choices=CONTENTS,
                    help="repeat: each document repeats a span of its own, over a small vocabulary subset (a small "
                         "model learns it); random: uniform random tokens (default repeat)")
    ap.add_argument("--vocab-subset", type=int, default=16,
                    help="--content repeat: ids the documents draw their tokens from (default 16)")
    ap.add_argument("--period", type=int, default=8,
                    help="--content repeat: length of the span each document repeats (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--chunk", type=int, default=16,
                    help="only for the printed summary: tokens per CP rank (--seq-length / CP; default 16)")
    args = ap.parse_args(argv)
    eod = args.vocab_size - 1 if args.eod_id is None else args.eod_id
    try:
        lengths = document_lengths(args.documents, args.mean_length, args.sigma, args.max_length,
                                   args.one_token_fraction, args.seed)
        info = write_dataset(args.prefix, lengths, args.vocab_size, eod, args.seed, args.content, args.vocab_subset,
                             args.period)
    except ValueError as e:
        print(f"make_doc_dataset: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the folder cannot be made, a file or folder in the way, no permission
        print(f"make_doc_dataset: error: cannot write {args.prefix}.bin / .idx: {e.strerror}: "
              f"{e.filename or args.prefix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"make_doc_dataset: interrupted (SIGINT): {args.prefix}.bin / .idx may be incomplete", file=sys.stderr)
        return 130
    print(f"{args.prefix}.bin/.idx: {info['documents']} documents, {info['tokens']} tokens ({info['dtype']}), EOD id "
          f"{eod}; {args.content} tokens; lengths min {lengths.min()}, median {int(np.median(lengths))}, mean {lengths.mean():.1f}, max "
          f"{lengths.max()}; {np.mean(lengths == 1):.0%} one token, {np.mean(lengths > args.chunk):.0%} longer than "
          f"{args.chunk} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
