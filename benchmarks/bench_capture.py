"""Cost of a capture: forward time armed against plain, and extra peak memory against one layer's maps.

Per architecture (built from code or configs, random weights, eval mode, float32):

Architectures: nn.TransformerEncoder, nanoGPT (SDPA), minGPT (vendored, attention by hand), HF GPT-2, LLaMA, BERT.

* time: ``connmon.capture(model, batch)`` against ``model(batch)`` under ``no_grad``, run alternately, median of
  ``--repeats`` pairs; the ratio is what one sampled step's forward costs.
* memory (CPU, Linux): the peak resident memory a capture adds over the plain forward's own peak (the high-water
  mark ``VmHWM`` reset before each run, freed heap returned to the OS first), for the list mode (all records
  kept) and the streaming mode (``on_record`` drops each record after reading it), in units of one layer's maps
  (``B_s x H x n x n`` float32 probabilities and logits and a bool mask).

* long sequences: the extra peak a capture adds to a forward over 4096 tokens (d = 32, 4 heads, 2 layers, 2
  sequences, streaming) for ``max_tokens`` 256 (the default), 1024 and None, in units of one window's map
  (``B_s x H x m x m`` float32): only the window is ever scored, so the target is at most 1.5. At 256 the map is
  2 MiB, near the resident-memory noise (about 1 MiB); the 1024 row resolves the ratio.

Usage:
    python benchmarks/bench_capture.py            # about 4 minutes on 2 CPU cores
    python benchmarks/bench_capture.py --long-only  # the long-sequence table alone, about 1 minute
    python benchmarks/bench_capture.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import connmon

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.capture.models import TinyGPT

WIDTH, HEADS, LAYERS, TOKENS, BATCH, SEQUENCES = 256, 8, 6, 512, 4, 2


def build(arch: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (BATCH, TOKENS))
    if arch == "nn.TransformerEncoder":
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, LAYERS), {"src": torch.randn(BATCH, TOKENS, WIDTH)}
    if arch == "nanoGPT":
        return TinyGPT(vocab=100, n_embd=WIDTH, n_head=HEADS, n_layer=LAYERS), {"idx": ids}
    if arch == "minGPT (by hand)":  # softmax by hand: read from the calls that run (the reading mode's cost)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vendored"))
        from mingpt.model import GPT

        config = GPT.get_default_config()
        config.merge_from_dict(
            dict(model_type=None, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, vocab_size=100, block_size=TOKENS)
        )
        with contextlib.redirect_stdout(io.StringIO()):  # minGPT prints its size
            return GPT(config), {"idx": ids}
    import transformers

    if arch == "HF GPT-2":
        config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=100, n_positions=TOKENS)
        return transformers.GPT2Model(config), {"input_ids": ids}
    if arch == "HF LLaMA (GQA)":
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS // 4, max_position_embeddings=TOKENS,
        )  # fmt: skip
        return transformers.LlamaModel(config), {"input_ids": ids}
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * WIDTH, max_position_embeddings=TOKENS,
    )  # fmt: skip
    return transformers.BertModel(config, add_pooling_layer=False), {"input_ids": ids}


ARCHITECTURES = ["nn.TransformerEncoder", "nanoGPT", "minGPT (by hand)", "HF GPT-2", "HF LLaMA (GQA)", "HF BERT"]


def timing(arch: str, device: torch.device, repeats: int) -> tuple[float, float]:
    model, inputs = build(arch)
    model = model.to(device).eval()
    inputs = {k: v.to(device) for k, v in inputs.items()}

    def plain() -> None:
        with torch.no_grad():
            model(**inputs)

    def armed() -> None:
        connmon.capture(model, num_sequences=SEQUENCES, max_tokens=None, **inputs)

    plain_times, armed_times = [], []
    for run in [plain, armed] * (repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        (plain_times if run is plain else armed_times).append(time.perf_counter() - start)
    return statistics.median(plain_times[1:]), statistics.median(armed_times[1:])


_LIBC = ctypes.CDLL("libc.so.6")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_extra(run: Callable[[], object]) -> int:
    """Peak resident memory that ``run`` adds (Linux: VmHWM after resetting it, freed heap returned first)."""
    gc.collect()
    _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark VmHWM to the current RSS
    before = _status("VmRSS")
    result = run()
    peak = _status("VmHWM") - before
    del result
    return peak


def memory_row(arch: str, one_layer: int) -> str:
    model, inputs = build(arch)
    model.eval()

    def plain() -> object:
        with torch.no_grad():
            return model(**inputs)

    def kept() -> object:
        return connmon.capture(model, num_sequences=SEQUENCES, max_tokens=None, **inputs)

    def streamed() -> object:
        return connmon.capture(model, num_sequences=SEQUENCES, max_tokens=None, on_record=lambda r: None, **inputs)

    plain()  # warm-up
    base = statistics.median(peak_extra(plain) for _ in range(3))
    all_kept = statistics.median(peak_extra(kept) for _ in range(3)) - base
    streaming = statistics.median(peak_extra(streamed) for _ in range(3)) - base
    return (
        f"| {arch} | {base / 2**20:.0f} MiB | {all_kept / 2**20:.0f} MiB | {all_kept / one_layer:.1f} "
        f"| {streaming / 2**20:.0f} MiB | {streaming / one_layer:.1f} |"
    )


LONG_TOKENS, LONG_WIDTH, LONG_HEADS, WINDOWS = 4096, 32, 4, (256, 1024, None)


def build_long(arch: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (SEQUENCES, LONG_TOKENS))
    if arch == "nanoGPT":
        return TinyGPT(vocab=100, n_embd=LONG_WIDTH, n_head=LONG_HEADS, n_layer=2), {"idx": ids}
    import transformers

    if arch == "HF LLaMA (GQA)":
        config = transformers.LlamaConfig(
            vocab_size=100, hidden_size=LONG_WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=LONG_HEADS, num_key_value_heads=2, max_position_embeddings=LONG_TOKENS,
        )  # fmt: skip
        return transformers.LlamaModel(config), {"input_ids": ids}
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=LONG_WIDTH, num_hidden_layers=2, num_attention_heads=LONG_HEADS,
        intermediate_size=64, max_position_embeddings=LONG_TOKENS,
    )  # fmt: skip
    return transformers.BertModel(config, add_pooling_layer=False), {"input_ids": ids}


def long_rows(arch: str) -> list[str]:
    model, inputs = build_long(arch)
    model.eval()

    def plain() -> object:
        with torch.no_grad():
            return model(**inputs)

    def streamed(max_tokens: int | None) -> Callable[[], object]:
        return lambda: connmon.capture(model, max_tokens=max_tokens, on_record=lambda r: None, **inputs)

    plain()  # warm-up
    base = statistics.median(peak_extra(plain) for _ in range(5))
    rows = []
    for window in WINDOWS:
        window_map = SEQUENCES * LONG_HEADS * (window or LONG_TOKENS) ** 2 * 4
        extra = statistics.median(peak_extra(streamed(window)) for _ in range(5)) - base
        rows.append(
            f"| {arch} | {window or 'None'} | {window_map / 2**20:.0f} MiB | {base / 2**20:.0f} MiB "
            f"| {extra / 2**20:.1f} MiB | {extra / window_map:.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="skip the CPU memory tables")
    parser.add_argument("--long-only", action="store_true", help="only the long-sequence memory table")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; d={WIDTH}, H={HEADS}, "
          f"{LAYERS} layers, batch {BATCH} x {TOKENS} tokens, recording {SEQUENCES} sequences\n")  # fmt: skip
    if not args.long_only:
        print("| architecture | plain forward ms | armed forward ms | armed / plain |")
        print("|---|---|---|---|")
        for arch in ARCHITECTURES:
            plain, armed = timing(arch, device, args.repeats)
            print(f"| {arch} | {plain * 1e3:.1f} | {armed * 1e3:.1f} | {armed / plain:.2f}x |", flush=True)
    if args.no_memory:
        return
    print(f"\nlong sequences: batch {SEQUENCES} x {LONG_TOKENS} tokens, d={LONG_WIDTH}, {LONG_HEADS} heads, 2 layers, "
          "streaming; a window's map is B_s x H x m x m float32\n")  # fmt: skip
    print("| architecture | max_tokens | one window's map | plain forward peak | extra peak, capture "
          "| in window maps |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for arch in ["nanoGPT", "HF LLaMA (GQA)", "HF BERT"]:
        print("\n".join(long_rows(arch)), flush=True)
    if args.long_only:
        return
    one_layer = SEQUENCES * HEADS * TOKENS * TOKENS * (4 + 4 + 1)  # probabilities, logits, mask
    print(f"\none layer's maps: {one_layer / 2**20:.1f} MiB (CPU resident memory, Linux VmHWM)\n")
    print("| architecture | plain forward peak | extra, all records kept | in layers' maps | extra, streaming "
          "| in layers' maps |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for arch in ARCHITECTURES:
        print(memory_row(arch, one_layer), flush=True)


if __name__ == "__main__":
    main()
