"""A training loop with Hugging Face accelerate and a leangrad engine.

Run it on one process (``python accelerate_loop.py OUT``) or several
(``accelerate launch --num_processes 2 accelerate_loop.py OUT``, or torchrun): accelerate
wraps the model in DDP, and the engine's gradients are averaged across the processes as
a plain step's are. ``--engine backprop`` is the plain loop, for comparison: it writes
the same weights, step by step. Saves the weights after each step to
``OUT/weights-ENGINE.pt``.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import leangrad
from leangrad.loss import per_example

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--engine", default="checkpoint")
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                      nn.GELU(), nn.Linear(32, 4)).double()
data = torch.utils.data.TensorDataset(torch.randn(64, 8, dtype=torch.float64),
                                      torch.randint(0, 4, (64,)))
loader = torch.utils.data.DataLoader(data, batch_size=8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
engine = leangrad.engine(args.engine)
accelerator.print(f"{accelerator.distributed_type} on {accelerator.num_processes} process(es)")

weights = []
for x, y in loader:
    with accelerator.accumulate(model):
        if args.engine == "backprop":  # the plain loop
            loss = F.cross_entropy(model(x), y)
        else:  # the engine computes the gradients; backward hands them over
            loss_fn = per_example(F.cross_entropy, y)  # a mean over examples: splittable
            loss = leangrad.surrogate_loss(engine, model, x, loss_fn)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weights.append([p.detach().clone() for p in accelerator.unwrap_model(model).parameters()])
if accelerator.is_main_process:
    torch.save(weights, f"{args.out}/weights-{args.engine}.pt")
