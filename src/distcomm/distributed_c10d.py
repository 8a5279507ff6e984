"""``distcomm.distributed_c10d``: torch.distributed.distributed_c10d's name for the same functions.

Programs written against torch sometimes import from the submodule (``from
torch.distributed.distributed_c10d import ...``); this module holds the very objects the package
exports, so either spelling gives the same function.
"""

from . import *  # noqa: F403 - the package's public names, defined before this module is imported
from . import __all__  # noqa: F401
