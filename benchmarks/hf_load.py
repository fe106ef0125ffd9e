"""Peak memory of loading a GPT-2-124M-shaped Hugging Face checkpoint with refmath.hf, against the
size of the parameters it produces, beside safetensors' own load_file of the same file.

The checkpoint is built here (random weights in GPT-2 small's shapes and names, written with
safetensors; nothing is downloaded), then each loader runs in a fresh Python process that reports
its peak resident memory (``VmHWM``) before and after the load. The difference is what the load
cost at its peak: it should be about the converted parameters plus one tensor, since
refmath.hf maps each tensor on its own and converts it at once. Nothing is asserted: the figures
belong to the machine. Linux only (it reads /proc/self/status).

    python benchmarks/hf_load.py                 # float32 file, float32 parameters
    python benchmarks/hf_load.py --file-dtype bf16
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import _common  # noqa: F401  (puts the checkout's refmath on sys.path)

GPT2_SMALL = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=50257,
                  n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                  activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  tie_word_embeddings=True)
LLAMA_3_8B_PARAMS = 8_030_261_248  # `python -m refmath sizes --preset llama-3-8b`
LLAMA_3_8B_LARGEST = 128256 * 4096  # its token table (and its untied head)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--file-dtype", choices=("f32", "f16", "bf16"), default="f32",
                        help="dtype of the tensors in the file (bf16: how most released "
                        "checkpoints are stored)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="dtype refmath.hf converts the parameters to")
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary "
                        "folder, removed afterwards)")
    return parser.parse_args(argv)


def gpt2_tensors(dtype) -> dict:
    """Random tensors with the names and shapes of GPT2LMHeadModel's safetensors file."""
    rng = np.random.default_rng(0)
    d, v, t, f = 768, 50257, 1024, 3072
    shapes = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (t, d),
              "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    for i in range(12):
        h = f"transformer.h.{i}."
        shapes.update({h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "ln_2.weight": (d,),
                       h + "ln_2.bias": (d,), h + "attn.c_attn.weight": (d, 3 * d),
                       h + "attn.c_attn.bias": (3 * d,), h + "attn.c_proj.weight": (d, d),
                       h + "attn.c_proj.bias": (d,), h + "mlp.c_fc.weight": (d, f),
                       h + "mlp.c_fc.bias": (f,), h + "mlp.c_proj.weight": (f, d),
                       h + "mlp.c_proj.bias": (d,)})
    return {name: (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
            for name, shape in shapes.items()}


def save_bf16(tensors: dict, path: Path) -> None:
    """A safetensors file of bfloat16 tensors, written by hand (safetensors.numpy cannot: NumPy
    has no bfloat16): each float32 cut to its upper 16 bits, after the 8-byte header length and
    the JSON header (padded to a multiple of 8 bytes, as safetensors does)."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        bits = (np.ascontiguousarray(t, np.float32).view(np.uint32) >> 16).astype("<u2")
        header[name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + bits.nbytes]}
        blobs.append(bits)
        offset += bits.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for bits in blobs:
            f.write(bits.tobytes())


def write_checkpoint(directory: Path, file_dtype: str) -> int:
    from safetensors.numpy import save_file

    path = directory / "model.safetensors"
    tensors = gpt2_tensors(np.float16 if file_dtype == "f16" else np.float32)
    if file_dtype == "bf16":
        save_bf16(tensors, path)
    else:
        save_file(tensors, str(path), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(GPT2_SMALL))
    return sum(t.size for t in tensors.values())


# Run in a fresh interpreter: the peak resident memory after the imports, then after the load, and
# the bytes of the arrays the load returned. The peak is Linux's VmHWM, which starts afresh at exec;
# ru_maxrss would not do: Linux carries the forking parent's peak over into it.
_MEASURE = """
import json, sys
from refmath import hf
from safetensors.numpy import load_file

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

how, directory, dtype = sys.argv[1:]
before = peak()
if how == "refmath":
    params = hf.load_checkpoint(directory, dtype=dtype)[2]
else:
    params = load_file(directory + "/model.safetensors")
after = peak()
print(json.dumps({"before": before, "after": after,
                  "bytes": sum(a.nbytes for a in params.values())}))
"""


def measure(how: str, directory: Path, dtype: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", _MEASURE, how, str(directory), dtype],
                            capture_output=True, text=True, cwd=root, check=True)
    return json.loads(result.stdout)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        steps = tqdm(total=3, desc="hf_load", file=sys.stderr)
        n = write_checkpoint(directory, args.file_dtype)
        steps.update()
        file_bytes = (directory / "model.safetensors").stat().st_size
        ours = measure("refmath", directory, args.dtype)
        steps.update()
        # safetensors.numpy cannot return bfloat16 arrays, so it has no figure for a bf16 file.
        peer = None if args.file_dtype == "bf16" else measure("safetensors", directory, args.dtype)
        steps.update()
        steps.close()

    mib = 2.0 ** 20
    print(f"GPT-2 124M shapes: {n:,} parameters, file {file_bytes / mib:.0f} MiB "
          f"({args.file_dtype})")
    print(f"{'loader':<42} {'result MiB':>11} {'peak extra MiB':>15} {'x result':>9}")
    rows = [(f"refmath.hf.load_checkpoint -> {args.dtype}", ours)]
    if peer is not None:
        rows.append(("safetensors.numpy.load_file (as stored)", peer))
    for label, m in rows:
        extra = m["after"] - m["before"]
        print(f"{label:<42} {m['bytes'] / mib:>11.0f} {extra / mib:>15.0f} "
              f"{extra / m['bytes']:>9.2f}")
    if peer is None:
        print("(safetensors.numpy.load_file cannot read bf16: NumPy has no bfloat16)")
    itemsize = np.dtype(args.dtype).itemsize
    print(f"an 8B model (Llama-3-8B, {LLAMA_3_8B_PARAMS:,} parameters) in {args.dtype}: "
          f"{LLAMA_3_8B_PARAMS * itemsize / 2 ** 30:.1f} GiB of parameters, plus about one "
          f"{LLAMA_3_8B_LARGEST * itemsize / 2 ** 30:.1f} GiB tensor (its token table) while "
          f"loading, by the ratio above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
