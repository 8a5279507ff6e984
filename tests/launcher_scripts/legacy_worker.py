"""A worker written for torch.distributed.launch: parses --local_rank, as the seed's docs show."""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
print(
    f"local_rank_arg={args.local_rank} LOCAL_RANK={os.environ.get('LOCAL_RANK')} RANK={os.environ['RANK']} "
    f"WORLD_SIZE={os.environ['WORLD_SIZE']} MASTER={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
    f"rest={args.rest}",
    flush=True,
)
