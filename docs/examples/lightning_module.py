"""A LightningModule whose gradients a leangrad engine computes.

``training_step`` returns :func:`leangrad.surrogate_loss`: the engine runs there, and the
backward Lightning calls on the returned loss (through its precision plugin, after its
division for ``accumulate_grad_batches``, inside DDP under a multi-device strategy) hands
the engine's gradients over, scaled as the loss was. Automatic optimisation, gradient
clipping and the optimizer are Lightning's, unchanged. ``engine="backprop"`` is the plain
module, for comparison. Run: ``python lightning_module.py OUT [--engine NAME]``; saves the
weights after each step to ``OUT/weights-ENGINE.pt``.
"""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import leangrad
from leangrad.loss import per_example


class Classifier(L.LightningModule):
    def __init__(self, engine: str = "checkpoint") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(),
                                 nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        self.engine = leangrad.engine(engine)
        self.weights: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.engine.name == "backprop":  # the plain module
            return F.cross_entropy(self.net(x), y)
        loss_fn = per_example(F.cross_entropy, y)  # a mean over examples: splittable
        return leangrad.surrogate_loss(self.engine, self.net, x, loss_fn)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.weights.append([p.detach().clone() for p in self.net.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def train(engine: str, devices: int = 1) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    module = Classifier(engine)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, dtype=torch.float64),
                                          torch.randint(0, 4, (64,)))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=devices, precision="64-true",
                        strategy="ddp" if devices > 1 else "auto",
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module.weights


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--engine", default="checkpoint")
    parser.add_argument("--devices", type=int, default=1)  # 2: Lightning's DDP on 2 processes
    args = parser.parse_args()
    weights = train(args.engine, args.devices)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(weights, f"{args.out}/weights-{args.engine}.pt")
