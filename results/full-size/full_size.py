"""Full-size zoo measurements of fragments beside PyTorch's best exact options.

Run alone: ``python results/full-size/full_size.py gpt [cuda]`` (or ``resnet``, ``unet``); writes
``/tmp/full_MODEL[_cuda].json``, gathered into ``results/full-size/full-size.json``. Tracker
peaks one by one (on CUDA: the caching allocator's), then times as interleaved medians of 3
after a warm-up round, 1 thread.
"""

import json
import sys
import time
import tomllib
from pathlib import Path

import torch

from leangrad import blocks, engine
from leangrad_bench._models import build
from leangrad_bench._zoo_methods import Method
from leangrad.engines.checkpoint._offers import stage_modules, stem_modules
from leangrad.measure import profile_step, time_interleaved


def torch_row(kind: str, k: int | None = None) -> object:
    label = f"torch {kind}" if kind == "per-block" else kind  # the zoo's peers' own key
    return Method(label, "pytorch", True, {"torch": kind, "arg": k}).make()


def main(name: str, device: str = "cpu") -> None:
    torch.manual_seed(0)
    suite = Path("benchmarks/leangrad_bench/suites/zoo.toml")
    size = dict(tomllib.loads(suite.read_text())["settings"]["models"][name])
    w = build(name, size, device=device)
    m, x, lf = w.model, w.inputs, w.loss_fn
    names = list(blocks(m).names)
    rows: dict[str, object] = {"backprop": engine("backprop"),
                               "torch per-block": torch_row("per-block"),
                               "checkpoint": engine("checkpoint")}  # fmt: skip
    if name == "resnet":  # BatchNorm: no micro-batches; the stem recomputed too
        every = ["stem", *names]
        rows["checkpoint(stem+blocks)"] = engine("checkpoint", blocks=every)
        del rows["checkpoint"]  # equal to torch per-block (measured before): time kept short
        rows["checkpoint(stem+blocks,fragments=8)"] = engine("checkpoint", blocks=every,
                                                              fragments=8)  # fmt: skip
        for k in (4, 8):  # only the blocks storing the most fragmented
            rows[f"checkpoint(stem+blocks,fragments={k},fragment_blocks=2)"] = engine(
                "checkpoint", blocks=every, fragments=k, fragment_blocks=2)  # fmt: skip
    elif name == "unet":  # whole stages (and the head) as blocks
        found = blocks(m)
        stages = [*stage_modules(m, found), *stem_modules(m, found)]
        rows["torch accumulate(4) + per-block"] = torch_row("accumulate+per-block", 4)
        rows["checkpoint+accumulate(4)"] = engine("checkpoint+accumulate", micro_batches=4)
        for k in (4, 8):
            rows[f"checkpoint(stages+out,fragments={k})"] = engine(
                "checkpoint", blocks=stages, fragments=k)  # fmt: skip
    else:
        for k in (4, 8):
            rows[f"torch accumulate({k}) + per-block"] = torch_row("accumulate+per-block", k)
            rows[f"checkpoint(fragments={k})"] = engine("checkpoint", fragments=k)
            rows[f"checkpoint+accumulate({k})"] = engine("checkpoint+accumulate",
                                                         micro_batches=k)  # fmt: skip
    peaks = {}
    for label, e in rows.items():
        start = time.time()
        peaks[label] = profile_step(e, m, x, lf, repeats=0).peak_bytes
        print(f"{label:40s} peak {peaks[label] / 2**20:8.1f} MiB "
              f"({peaks[label] / peaks['backprop']:.3f}x) [{time.time() - start:.0f}s]",
              flush=True)  # fmt: skip

    def step(e: object) -> object:
        def run() -> None:
            m.zero_grad(set_to_none=True)
            e.backward(m, x, lf)  # type: ignore[attr-defined]

        return run

    times = time_interleaved({k: step(e) for k, e in rows.items()},  # type: ignore[misc]
                             repeats=3, warmup=1, reference="backprop")  # fmt: skip
    out = {}
    for label in rows:
        t = times[label]
        print(f"{label:40s} peak {peaks[label] / peaks['backprop']:.3f}x  time {t.ratio:.2f}x "
              f"({t.median:.2f} s)", flush=True)  # fmt: skip
        out[label] = {"peak_bytes": peaks[label], "peak_ratio": peaks[label] / peaks["backprop"],
                      "seconds": t.median, "time_ratio": t.ratio}  # fmt: skip
    gpu = torch.cuda.get_device_name() if device != "cpu" else None
    result = {"model": name, "size": size, "device": device, "gpu": gpu, "torch": torch.__version__,
              "rows": out}  # fmt: skip
    tail = "" if device == "cpu" else f"_{device}"
    Path(f"/tmp/full_{name}{tail}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
