"""The start-up checks that look at the file system: the datasets Megatron's data flags name
(:func:`check_data_files`; :func:`data_blends`, their prefixes) and the metrics directory -- each
missing or wrong one a ValueError naming the flag, the path and the way out, before anything is
built (:func:`.bootstrap.check_args` runs them after :func:`.checks.validate_args`)."""

from __future__ import annotations

import json
import os

from .settings import PluginSettings

__all__ = ["check_data_files", "data_blends"]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
MAKE_DOC_DATASET = os.path.join("scripts", "make_doc_dataset.py")  # writes the documents configs' DOC_DATA


def _prefixes(values) -> list[str]:
    """The dataset prefixes of a Megatron blend list, by Megatron's rule (get_blend_from_list):
    ``weight prefix weight prefix ...`` when the list has even length and every other item is a
    number, else every item is a prefix."""
    values = [str(v).strip() for v in values]
    if len(values) % 2:
        return values
    try:
        for weight in values[0::2]:
            float(weight)
    except ValueError:
        return values
    return values[1::2]


def data_blends(args) -> list[tuple[str, list[str]]]:
    """(flag and value as given, the prefixes) of each dataset list the arguments name; a
    --data-args-path / --per-split-data-args-path file that is missing or that Megatron would not
    parse either is a ValueError / left to Megatron."""
    blends = []
    if getattr(args, "data_path", None):
        blends.append((f"--data-path {' '.join(map(str, args.data_path))}", _prefixes(args.data_path)))
    for split in ("train", "valid", "test"):
        values = getattr(args, f"{split}_data_path", None)
        if values:
            blends.append((f"--{split}-data-path {' '.join(map(str, values))}", _prefixes(values)))
    for flag, name in (("--data-args-path", "data_args_path"), ("--per-split-data-args-path", "per_split_data_args_path")):
        path = getattr(args, name, None)
        if not path or "://" in path:
            continue
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
        with open(path) as f:
            text = f.read()
        if name == "data_args_path":
            blends.append((f"{flag} {path}", _prefixes(text.split())))
            continue
        try:
            splits = json.loads(text)
            lists = [splits[k].split() if isinstance(splits[k], str) else splits[k] for k in ("train", "valid", "test")]
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # Megatron names what is wrong with the file
        blends.extend((f"{flag} {path}", _prefixes(values)) for values in lists if values)
    return blends


def check_data_files(args) -> None:
    """ValueError naming the missing files when a dataset prefix that the arguments name
    (--data-path, --train/valid/test-data-path, the lists of --data-args-path and
    --per-split-data-args-path) has no PREFIX.bin or PREFIX.idx: Megatron would find out in every
    rank while it builds the datasets, after initialising, with an AssertionError per rank and
    then "'IndexedDataset' object has no attribute 'bin_reader'". A missing prefix that is the
    document configs' DOC_DATA (configs/gpt_tiny_cpu_docs.yaml's data/tiny_docs) gets the
    command that writes it. Not checked: --mock-data (Megatron makes its tokens up), object-store
    paths (``s3://``, ``msc://``), and --dataloader-fast-cache-load (Megatron's cached indices may
    stand in for the files). Also --cp-metrics-dir: a directory, made here where it is missing --
    every rank would otherwise fail to make it while Megatron builds the model, a traceback each
    (a file on its path, a folder it may not write in)."""
    metrics_dir = PluginSettings.from_args(args).cp_metrics_dir
    if metrics_dir:
        if os.path.exists(metrics_dir) and not os.path.isdir(metrics_dir):
            raise ValueError(f"--cp-metrics-dir {metrics_dir}: that is a file, not a directory; name a directory (it "
                             "is created if missing)")
        try:
            os.makedirs(metrics_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--cp-metrics-dir {metrics_dir}: cannot make that directory ({e.strerror}); name a "
                             "directory this process may write in") from None
    if getattr(args, "mock_data", False) or getattr(args, "dataloader_fast_cache_load", False):
        return
    for given, prefixes in data_blends(args):
        prefixes = [p for p in prefixes if "://" not in p]
        missing = [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]
        if not missing:
            continue
        where = f" (relative to {os.getcwd()})" if any(not os.path.isabs(m) for m in missing) else ""
        hint = "give the prefix of an existing Megatron indexed dataset (PREFIX.bin + PREFIX.idx), or --mock-data"
        doc_data = os.environ.get("DOC_DATA")
        if doc_data in prefixes and any(m.startswith(doc_data + ".") for m in missing) \
                and os.path.isfile(os.path.join(ROOT, MAKE_DOC_DATASET)):
            here = os.path.realpath(os.getcwd()) == os.path.realpath(ROOT)
            python = os.path.join(ROOT, ".venv", "bin", "python")
            python = (os.path.relpath(python, ROOT) if here else python) if os.path.exists(python) else "python"
            script = MAKE_DOC_DATASET if here else os.path.join(ROOT, MAKE_DOC_DATASET)
            hint = (f"write the documents first: {python} {script} {doc_data} (DOC_DATA sets the prefix the document "
                    "configs read)")
        shown = given if len(given) <= 200 else given[:200] + " ..."
        raise ValueError(f"{shown}: no dataset there, {', '.join(missing)} not found{where}; {hint}")
