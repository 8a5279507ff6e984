"""A worker written for torch.distributed.launch: accepts both spellings, as torch's docs advise
(torch >= 2.0 passes ``--local-rank``; older launchers passed ``--local_rank``)."""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
line = (
    f"local_rank_arg={args.local_rank} LOCAL_RANK={os.environ.get('LOCAL_RANK')} RANK={os.environ['RANK']} "
    f"WORLD_SIZE={os.environ['WORLD_SIZE']} MASTER={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
    f"rest={args.rest} argv={sys.argv[1:]}"
)
# one write: both workers share the launcher's stdout, and unbuffered print() writes the line and its
# newline separately, so another worker's line could land between them
os.write(1, (line + "\n").encode())
