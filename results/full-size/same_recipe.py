"""The same recipe, leangrad's engine beside PyTorch's loop, timed in one process (1 thread).

Usage: python same_recipe.py REPO [--model NAME] [--rounds R] [--k 4,8] [--per-block] [--quick]
(default bert, 12 rounds, k = 4 and 8; --quick: the zoo's quick sizes, a smoke test). For each k: ``accumulate(micro_batches=k)`` (leangrad)
and the zoo's ``torch accumulate(k)`` (the practitioner's loop), and backprop; interleaved
rounds after a warm-up round, each round in an order rotated by one. --per-block: with
every block but the last checkpointed inside each micro-batch on both sides
(``checkpoint+accumulate(blocks=[all but the last], micro_batches=k)``, the plan's ⅛
choice on BERT and the GPT, beside the zoo's ``torch accumulate(k) + per-block``). Prints each one's median
over the rounds, its ratio to backprop, and per k the median over rounds of the paired ratio
leangrad / PyTorch (the two timed in the same round), with its lowest and highest."""
import statistics
import sys
import time
import tomllib
from pathlib import Path

repo = Path(sys.argv[1])
sys.path.insert(0, str(repo / "src"))
import torch  # noqa: E402

torch.set_num_threads(1)
import leangrad  # noqa: E402
from leangrad_bench._models import build  # noqa: E402
from leangrad_bench._zoo_methods import TorchStep  # noqa: E402
from leangrad.engines._blocks import blocks  # noqa: E402
from leangrad.engines.checkpoint._offers import all_but_last  # noqa: E402

args = sys.argv[2:]
name = args[args.index("--model") + 1] if "--model" in args else "bert"
rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 12
ks = [int(k) for k in (args[args.index("--k") + 1] if "--k" in args else "4,8").split(",")]
suite = tomllib.loads((repo / "benchmarks/leangrad_bench/suites/zoo.toml").read_text())
sizes = suite["settings"]["quick_models" if "--quick" in args else "models"]
w = build(name, dict(sizes[name]))
steps = {"backprop": leangrad.engine("backprop")}
per_block = "--per-block" in args
but_last = all_but_last(blocks(w.model)) if per_block else None
for k in ks:
    if per_block:
        steps[f"leangrad accumulate({k})"] = leangrad.engine(
            "checkpoint+accumulate", blocks=but_last, micro_batches=k)
        steps[f"torch accumulate({k})"] = TorchStep(
            f"torch accumulate({k}) + per-block", "accumulate+per-block", k)
    else:
        steps[f"leangrad accumulate({k})"] = leangrad.engine("accumulate", micro_batches=k)
        steps[f"torch accumulate({k})"] = TorchStep(f"torch accumulate({k})", "accumulate", k)


def run(step: object) -> None:
    w.model.zero_grad(set_to_none=True)
    step.backward(w.model, w.inputs, w.loss_fn)  # type: ignore[attr-defined]


names = list(steps)
times: dict[str, list[float]] = {n: [] for n in names}
for r in range(rounds + 1):
    order = names[r % len(names):] + names[: r % len(names)]
    for n in order:
        t = time.perf_counter()
        run(steps[n])
        if r:  # round 0 is the warm-up
            times[n].append(time.perf_counter() - t)
base = statistics.median(times["backprop"])
print(f"# {name}, {rounds} interleaved rounds after a warm-up round, 1 thread, torch {torch.__version__}"
      + (f"; accumulate(k) = checkpoint(blocks={but_last})+accumulate and torch accumulate(k) + per-block"
         if per_block else ""))
for n in names:
    med = statistics.median(times[n])
    print(f"{n:26s} median {med:.4f} s  ({med / base:.3f}x backprop)  "
          f"min {min(times[n]):.4f}  max {max(times[n]):.4f}")
for k in ks:
    paired = [a / b for a, b in zip(times[f"leangrad accumulate({k})"], times[f"torch accumulate({k})"])]
    print(f"k={k}: leangrad / PyTorch, paired per round: median {statistics.median(paired):.3f} "
          f"(lowest {min(paired):.3f}, highest {max(paired):.3f}; "
          f"{sum(p < 1 for p in paired)} of {len(paired)} rounds below 1)")
