"""Codec throughput, wire size and error on one large tensor; hivemind's codecs side by side.

    python benchmarks/benchmark_compression.py [--numel 16777216] [--runs 5]
        [--hivemind-python /tmp/hm/bin/python] [--codecs Float16,Quantile8Bit]

MB/s is raw float32 bytes / (encode + decode time), medians over ``--runs`` after one warm-up.
``--codecs`` keeps the codecs whose name contains one of the given comma-separated parts.
hivemind's codecs run in this interpreter when it can import hivemind, else in the interpreter
given by ``--hivemind-python`` (a separate venv: hivemind 1.1.12 needs numpy<2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def measure(compress, extract, size_of, tensor, runs: int) -> dict:
    import torch

    encode, decode = [], []
    message = compress(tensor)  # warm-up: caches, scratch buffers
    restored = extract(message)
    for _ in range(runs):
        start = time.perf_counter()
        message = compress(tensor)
        middle = time.perf_counter()
        restored = extract(message)
        encode.append(middle - start)
        decode.append(time.perf_counter() - middle)
    enc, dec = statistics.median(encode), statistics.median(decode)
    return {
        "encode_ms": enc * 1e3,
        "decode_ms": dec * 1e3,
        "mb_per_s": tensor.numel() * 4 / (enc + dec) / 1e6,
        "wire_bytes": size_of(message),
        "mse": float(torch.mean((tensor - restored.float()) ** 2)),
    }


def selected(name: str, parts: list[str] | None) -> bool:
    return parts is None or any(part in name for part in parts)


def swarmtrain_results(tensor, runs: int, parts: list[str] | None = None) -> dict[str, dict]:
    from swarmtrain import compression as c

    codecs = {
        "NoCompression": c.NoCompression(),
        "Float16Compression": c.Float16Compression(),
        "ScaledFloat16Compression": c.ScaledFloat16Compression(),
        "Uniform8BitQuantization": c.Uniform8BitQuantization(),
        "Quantile8BitQuantization": c.Quantile8BitQuantization(),
        "BlockwiseQuantization": c.BlockwiseQuantization(backend="torch"),
        "Blockwise4BitQuantization": c.Blockwise4BitQuantization(),
        "TopKSparsification(1%)": c.TopKSparsification(0.01),
    }
    if c.bitsandbytes_available():
        codecs["BlockwiseQuantization[bnb]"] = c.BlockwiseQuantization(backend="bitsandbytes")
    results = {}
    for name, codec in codecs.items():
        if not selected(name, parts):
            continue
        results[name] = measure(
            codec.compress, codec.extract, lambda m: m.nbytes + 16, tensor, runs
        )
    return results


def hivemind_results(tensor, runs: int, parts: list[str] | None = None) -> dict[str, dict]:
    import hivemind.compression as h

    names = [
        "NoCompression",
        "Float16Compression",
        "ScaledFloat16Compression",
        "Uniform8BitQuantization",
        "Quantile8BitQuantization",
        "BlockwiseQuantization",
    ]
    info = h.CompressionInfo.from_tensor(tensor)
    results = {}
    for name in names:
        if not selected(name, parts):
            continue
        try:
            codec = getattr(h, name)()
            results[name] = measure(
                lambda t, codec=codec: codec.compress(t, info),
                codec.extract,
                lambda m: m.ByteSize(),
                tensor,
                runs,
            )
        except Exception as e:  # e.g. BlockwiseQuantization without bitsandbytes
            message = str(e).splitlines()[0] if str(e) else ""
            results[name] = {"error": f"{type(e).__name__}: {message}"[:60]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hivemind-python", default=None)
    parser.add_argument("--codecs", default=None, help="comma-separated parts of codec names")
    parser.add_argument("--only-hivemind", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    parts = args.codecs.split(",") if args.codecs else None

    import torch

    tensor = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    if args.only_hivemind:
        print(json.dumps(hivemind_results(tensor, args.runs, parts)))
        return

    ours = swarmtrain_results(tensor, args.runs, parts)
    theirs: dict[str, dict] = {}
    try:
        theirs = hivemind_results(tensor, args.runs, parts)
    except ImportError:
        if args.hivemind_python:
            command = [args.hivemind_python, __file__, "--only-hivemind"]
            command += ["--numel", str(args.numel), "--runs", str(args.runs)]
            command += ["--codecs", args.codecs] if args.codecs else []
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            theirs = json.loads(output.strip().splitlines()[-1])

    print(
        f"numel={args.numel} float32 (N(0,1)), runs={args.runs}, torch threads="
        f"{torch.get_num_threads()}, python {sys.version.split()[0]}"
    )
    header = f"{'codec':30s} {'enc ms':>8s} {'dec ms':>8s} {'MB/s':>8s} {'wire MB':>8s} {'MSE':>9s}"
    header += f" | {'hivemind MB/s':>13s} {'MSE':>9s} {'speedup':>7s}"
    print(header)
    print("-" * len(header))
    for name, row in ours.items():
        line = (
            f"{name:30s} {row['encode_ms']:8.1f} {row['decode_ms']:8.1f} {row['mb_per_s']:8.0f} "
            f"{row['wire_bytes'] / 1e6:8.2f} {row['mse']:9.2e}"
        )
        other = theirs.get(name.split("[")[0]) if "[" not in name else None
        if other and "error" not in other:
            speedup = row["mb_per_s"] / other["mb_per_s"]
            line += f" | {other['mb_per_s']:13.0f} {other['mse']:9.2e} {speedup:6.1f}x"
        elif other:
            line += f" | {other['error']}"
        print(line)


if __name__ == "__main__":
    main()
