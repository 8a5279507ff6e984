"""The main demo: the PyTorch tutorial's distributed synchronous SGD, on distcomm, on real digits.

``python -m distcomm.demo`` (``make demo``) starts ``distcomm-run --standalone --nproc-per-node N
-m distcomm.demo --worker`` and shows its output with a live progress bar. Each worker is the
program of "Writing Distributed Applications with PyTorch" with ``import distcomm as dist`` in place
of ``import torch.distributed as dist``:

- the dataset is scikit-learn's handwritten digits (1,797 real 8x8 scans that ship inside the
  scikit-learn wheel: no download), split once into 1,437 for training and 360 held out; the
  training part is split with the tutorial's DataPartitioner, one partition per rank, batch size
  64 / world size;
- every step, ``average_gradients(model)`` all_reduces each gradient and divides by the world
  size (``--ddp``: DistributedDataParallel does it instead, bucketed and overlapped);
- after every epoch the ranks score the held-out digits together (each its share, the counts
  summed with all_reduce); every rank prints its mean loss;
- at the end, rank 0 gathers every rank's loss curve (gather_object) and saves a plot of the
  curves and of the held-out accuracy (``--plot``), and prints its path.

Run a worker set by hand with ``distcomm-run --standalone --nproc-per-node 2 -m distcomm.demo --worker``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

PROGRESS_ENV = "DISTCOMM_DEMO_PROGRESS"
PROGRESS_TAG = "@progress"
TEST_SIZE = 360  # held out of the 1,797 digits; the rest train


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distcomm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="worker processes (2 to 4 is the point; default 2)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", default="gloo", help="distcomm engine (default: gloo, distcomm's default)")
    p.add_argument("--ddp", action="store_true", help="use DistributedDataParallel instead of average_gradients")
    p.add_argument("--plot", default="distcomm-demo.png", help="where to save the plot (default: %(default)s)")
    p.add_argument("--worker", action="store_true", help="run as one worker (under distcomm-run)")
    return p


# -- the tutorial's program ---------------------------------------------------------------------
def make_net():
    """The tutorial's convolutional network, sized for 8x8 inputs."""
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 16, kernel_size=3, padding=1)
            self.conv2 = torch.nn.Conv2d(16, 32, kernel_size=3, padding=1)
            self.conv2_drop = torch.nn.Dropout2d(0.1)
            self.fc1 = torch.nn.Linear(32 * 2 * 2, 64)
            self.fc2 = torch.nn.Linear(64, 10)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = x.flatten(1)
            x = F.relu(self.fc1(x))
            x = F.dropout(x, p=0.2, training=self.training)
            return F.log_softmax(self.fc2(x), dim=1)

    return Net()


def digits():
    """(train, test) TensorDatasets of scikit-learn's 8x8 digits, scaled to [0, 1]; the same split
    on every rank (a fixed permutation)."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]

    def dataset(index):
        return torch.utils.data.TensorDataset(torch.from_numpy(images[index]), torch.from_numpy(labels[index]))

    return dataset(train), dataset(test)


def partition_dataset(dist, train):
    """The tutorial's partition_dataset: one DataPartitioner partition per rank, batch 64/size."""
    import torch

    from ..utils.data import DataPartitioner

    size = dist.get_world_size()
    bsz = 64 // size
    partition = DataPartitioner(train, [1.0 / size for _ in range(size)]).use(dist.get_rank())
    return torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True), bsz


def average_gradients(dist, model) -> None:
    """The tutorial's gradient averaging: one all_reduce per parameter."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def evaluate(dist, model, test) -> float:
    """Accuracy on the held-out digits: each rank scores its share, the counts are summed."""
    import torch

    from ..utils.data import DistributedSampler

    loader = torch.utils.data.DataLoader(test, batch_size=256, sampler=DistributedSampler(test, shuffle=False))
    counts = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for data, target in loader:
            counts[0] += (model(data).argmax(1) == target).sum()
            counts[1] += len(target)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def save_plot(path: str, losses: list[list[float]], accuracy: list[float], steps_per_epoch: int) -> str:
    """Each rank's training loss per step and the held-out accuracy per epoch, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for rank, curve in enumerate(losses):
        left.plot([(i + 1) / steps_per_epoch for i in range(len(curve))], curve, label=f"rank {rank}", alpha=0.8)
    left.set(xlabel="epoch", ylabel="training loss (NLL)", yscale="log", title="loss of each rank's batches")
    left.legend()
    right.plot(range(1, len(accuracy) + 1), [100 * a for a in accuracy], marker="o")
    right.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100),
              title=f"accuracy on {TEST_SIZE} held-out digits")
    right.grid(alpha=0.3)
    fig.suptitle(f"distcomm: synchronous SGD on {len(losses)} processes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return os.path.abspath(path)


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import distcomm as dist
    from distcomm.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    show_progress = os.environ.get(PROGRESS_ENV) == "1" and rank == 0
    torch.manual_seed(1234)
    train, test = digits()
    train_set, bsz = partition_dataset(dist, train)
    model = make_net()
    if args.ddp:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    num_batches = len(train_set)
    losses: list[float] = []
    accuracy: list[float] = []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        epoch_loss = 0.0
        for i, (data, target) in enumerate(train_set):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            losses.append(loss.item())
            epoch_loss += losses[-1]
            loss.backward()
            if not args.ddp:
                average_gradients(dist, model)
            optimizer.step()
            if show_progress:
                print(f"{PROGRESS_TAG} {epoch + 1} {args.epochs} {i + 1} {num_batches} {epoch_loss / (i + 1):.4f}",
                      flush=True)
        accuracy.append(evaluate(dist, model, test))
        print(f"rank {rank}  epoch {epoch + 1:2d}/{args.epochs}  loss {epoch_loss / num_batches:.4f}  "
              f"held-out accuracy {100 * accuracy[-1]:.1f}%", flush=True)
    seconds = time.perf_counter() - start
    curves = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(losses, curves, dst=0)
    if rank == 0:
        how = "DistributedDataParallel" if args.ddp else "average_gradients (one all_reduce per parameter)"
        print(f"trained {args.epochs} epochs in {seconds:.1f} s on {dist.get_world_size()} processes, "
              f"batch {bsz} per rank, gradients averaged by {how}", flush=True)
        print(f"accuracy on {TEST_SIZE} held-out digits: {100 * accuracy[-1]:.1f}%", flush=True)
        print(f"plot of the loss curves and the accuracy: {save_plot(args.plot, curves, accuracy, num_batches)}",
              flush=True)
    dist.destroy_process_group()


# -- the launcher side ----------------------------------------------------------------------------
class _Display:
    """Pass the workers' lines through; draw ``@progress`` lines as one bar redrawn in place
    (on a terminal), or drop them (in a log)."""

    def __init__(self, stream):
        self.stream = stream
        self.tty = stream.isatty()
        self.bar = ""

    def line(self, text: str) -> None:
        body = text.split(": ", 1)[1] if text.startswith("[rank") and ": " in text else text
        if body.startswith(PROGRESS_TAG):
            fields = body.split()
            epoch, epochs, batch, batches = (int(v) for v in fields[1:5])
            if self.tty:
                done = 30 * batch // batches
                self.bar = (f"  epoch {epoch:2d}/{epochs} [{'#' * done}{'.' * (30 - done)}] {batch}/{batches} batches"
                            f"  loss {fields[5]}")
                self.stream.write("\r" + self.bar)
                self.stream.flush()
            return
        if self.bar:
            self.stream.write("\r" + " " * len(self.bar) + "\r")
        self.stream.write(text + "\n")
        if self.bar:
            self.stream.write(self.bar)
        self.stream.flush()

    def close(self) -> None:
        if self.bar:
            self.stream.write("\r" + " " * len(self.bar) + "\r")
            self.stream.flush()


def launch(args) -> int:
    forwarded = ["--epochs", str(args.epochs), "--lr", str(args.lr), "--backend", args.backend,
                 "--plot", args.plot] + (["--ddp"] if args.ddp else [])
    # --rank-prefix: every line says which rank printed it (torchrun's default prints lines bare)
    cmd = [sys.executable, "-m", "distcomm.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "--rank-prefix", "-m", "distcomm.demo", "--worker", *forwarded]
    print(f"distcomm demo: the PyTorch tutorial's synchronous SGD on {args.nproc} processes "
          f"(scikit-learn's 1,797 handwritten 8x8 digits, {TEST_SIZE} held out; {args.epochs} epochs)", flush=True)
    print("$ distcomm-run " + " ".join(cmd[3:]), flush=True)
    env = dict(os.environ, **{PROGRESS_ENV: "1"})
    display = _Display(sys.stdout)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    try:
        for line in proc.stdout:
            display.line(line.rstrip("\n"))
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    display.close()
    print(f"done in {time.perf_counter() - start:.1f} s (exit code {code})", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    missing = [name for name in ("torch", "sklearn", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"the demo needs {', '.join(missing)}: pip install -e '.[demo]'", file=sys.stderr)
        return 1
    return launch(args)
