#!/usr/bin/env python
"""Write a small Megatron indexed dataset (PREFIX.bin + PREFIX.idx) of random-token documents of
mixed lengths, each ending with the tokenizer's end-of-document (EOD) token -- data for
``--data-path PREFIX`` with ``--reset-attention-mask`` (documents cut at EOD tokens) or
``--cp-thd-packing`` (packed sequences) in the plugin's entry script.

Document lengths (EOD included) are lognormal with the given mean, rounded and clipped to
[1, --max-length]; a --one-token-fraction of the documents are a lone EOD token. With the
defaults (mean 12, sigma 1) at --seq-length 64 and CP 4 (chunks of 16 tokens, halves of 8) a
sample holds ~5 documents: about 1 in 5 is longer than a chunk, some span several samples, and
about 1 in 12 is a single token. Token ids are uniform in [0, EOD); the EOD id is NullTokenizer's,
``--vocab-size - 1``.

    scripts/make_doc_dataset.py data/tiny_docs            # what configs/gpt_tiny_cpu_docs.yaml reads
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
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if sigma < 0:
        raise ValueError(f"--sigma must be >= 0, got {sigma}")
    if not 0 <= one_token_fraction <= 1:
        raise ValueError(f"--one-token-fraction must be in [0, 1], got {one_token_fraction}")
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # E[lognormal(mu, sigma)] = mean
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, documents)), 1, max_length).astype(np.int64)
    lengths[rng.random(documents) < one_token_fraction] = 1
    return lengths


def write_dataset(prefix: str, lengths, vocab_size: int, eod: int, seed: int) -> dict:
    """Write PREFIX.bin / PREFIX.idx: one document per length, random tokens in [0, eod) ending
    with ``eod``. Returns a summary (documents, tokens, dtype)."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if not 0 < eod < vocab_size:
        raise ValueError(f"--eod-id {eod} must be in [1, --vocab-size {vocab_size})")
    if os.path.dirname(prefix):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
    dtype = DType.optimal_dtype(vocab_size)
    rng = np.random.default_rng(seed + 1)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for n in lengths:
        doc = np.concatenate([rng.integers(0, eod, int(n) - 1), [eod]]).astype(np.int64)
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
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--chunk", type=int, default=16,
                    help="only for the printed summary: tokens per CP rank (--seq-length / CP; default 16)")
    args = ap.parse_args(argv)
    eod = args.vocab_size - 1 if args.eod_id is None else args.eod_id
    try:
        lengths = document_lengths(args.documents, args.mean_length, args.sigma, args.max_length,
                                   args.one_token_fraction, args.seed)
        info = write_dataset(args.prefix, lengths, args.vocab_size, eod, args.seed)
    except ValueError as e:
        print(f"make_doc_dataset: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.prefix}.bin/.idx: {info['documents']} documents, {info['tokens']} tokens ({info['dtype']}), EOD id "
          f"{eod}; lengths min {lengths.min()}, median {int(np.median(lengths))}, mean {lengths.mean():.1f}, max "
          f"{lengths.max()}; {np.mean(lengths == 1):.0%} one token, {np.mean(lengths > args.chunk):.0%} longer than "
          f"{args.chunk} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
