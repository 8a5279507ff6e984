"""The main demo: the PyTorch tutorial's distributed synchronous SGD, on distcomm.

``python -m distcomm.demo`` (``make demo``) starts ``distcomm-run --standalone --nproc-per-node N
-m distcomm.demo --worker`` and shows its output with a progress bar. Each worker is the program
of "Writing Distributed Applications with PyTorch" with ``import distcomm as dist`` in place of
``import torch.distributed as dist``:

- the dataset (16x16 digits made on the spot by ``distcomm.demo.digits``; no download) is split
  with the tutorial's DataPartitioner, one partition per rank, batch size 128 / world size;
- every step, ``average_gradients(model)`` all_reduces each gradient and divides by the world
  size (``--ddp``: DistributedDataParallel does it instead, bucketed and overlapped);
- every rank prints its mean loss per epoch; at the end the ranks evaluate the held-out digits
  together (each its share, counts summed with all_reduce) and rank 0 prints the accuracy.

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distcomm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="worker processes (2 to 4 is the point; default 2)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-size", type=int, default=6000)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", default="gloo", help="distcomm engine (default: gloo, distcomm's default)")
    p.add_argument("--ddp", action="store_true", help="use DistributedDataParallel instead of average_gradients")
    p.add_argument("--worker", action="store_true", help="run as one worker (under distcomm-run)")
    return p


# -- the tutorial's program ---------------------------------------------------------------------
def make_net():
    """The tutorial's MNIST network, sized for 16x16 inputs."""
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=3)
            self.conv2_drop = torch.nn.Dropout2d()
            self.fc1 = torch.nn.Linear(80, 50)
            self.fc2 = torch.nn.Linear(50, 10)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = x.flatten(1)
            x = F.relu(self.fc1(x))
            x = F.dropout(x, training=self.training)
            return F.log_softmax(self.fc2(x), dim=1)

    return Net()


def digits_dataset(n: int, seed: int):
    import torch

    from .digits import make_digits

    images, labels = make_digits(n, seed)
    return torch.utils.data.TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))


def partition_dataset(dist, train_size: int):
    """The tutorial's partition_dataset: one DataPartitioner partition per rank, batch 128/size."""
    import torch

    from ..utils.data import DataPartitioner

    dataset = digits_dataset(train_size, seed=1)
    size = dist.get_world_size()
    bsz = 128 // size
    partition = DataPartitioner(dataset, [1.0 / size for _ in range(size)]).use(dist.get_rank())
    return torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True), bsz


def average_gradients(dist, model) -> None:
    """The tutorial's gradient averaging: one all_reduce per parameter."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def evaluate(dist, model, test_size: int) -> float:
    """Accuracy on the held-out digits: each rank scores its share, the counts are summed."""
    import torch

    from ..utils.data import DistributedSampler

    test = digits_dataset(test_size, seed=2)
    loader = torch.utils.data.DataLoader(test, batch_size=256, sampler=DistributedSampler(test, shuffle=False))
    counts = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for data, target in loader:
            counts[0] += (model(data).argmax(1) == target).sum()
            counts[1] += len(target)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


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
    train_set, bsz = partition_dataset(dist, args.train_size)
    model = make_net()
    if args.ddp:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    num_batches = len(train_set)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        epoch_loss = 0.0
        for i, (data, target) in enumerate(train_set):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            epoch_loss += loss.item()
            loss.backward()
            if not args.ddp:
                average_gradients(dist, model)
            optimizer.step()
            if show_progress and (i % 4 == 3 or i == num_batches - 1):
                print(f"{PROGRESS_TAG} {epoch + 1} {args.epochs} {i + 1} {num_batches}", flush=True)
        print(f"rank {rank}  epoch {epoch + 1:2d}/{args.epochs}  loss {epoch_loss / num_batches:.4f}", flush=True)
    seconds = time.perf_counter() - start
    accuracy = evaluate(dist, model, args.test_size)
    if rank == 0:
        how = "DistributedDataParallel" if args.ddp else "average_gradients (one all_reduce per parameter)"
        print(f"trained {args.epochs} epochs in {seconds:.1f} s on {dist.get_world_size()} processes, "
              f"batch {bsz} per rank, gradients averaged by {how}", flush=True)
        print(f"accuracy on {args.test_size} held-out digits: {100 * accuracy:.1f}%", flush=True)
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
            epoch, epochs, batch, batches = (int(v) for v in body.split()[1:5])
            if self.tty:
                done = 30 * batch // batches
                self.bar = f"  epoch {epoch:2d}/{epochs} [{'#' * done}{'.' * (30 - done)}] {batch}/{batches} batches"
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
    forwarded = ["--epochs", str(args.epochs), "--train-size", str(args.train_size), "--test-size",
                 str(args.test_size), "--lr", str(args.lr), "--backend", args.backend] + (["--ddp"] if args.ddp else [])
    cmd = [sys.executable, "-m", "distcomm.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "-m", "distcomm.demo", "--worker", *forwarded]
    print(f"distcomm demo: the PyTorch tutorial's synchronous SGD on {args.nproc} processes "
          f"({args.train_size} synthetic 16x16 digits, {args.epochs} epochs)", flush=True)
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
    if importlib.util.find_spec("torch") is None:
        print("the demo trains a torch model: install torch first (pip install -e '.[torch]')", file=sys.stderr)
        return 1
    return launch(args)
