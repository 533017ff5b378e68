#!/usr/bin/python3
# bench/goodput_torchrun.py: torchrun (torch.distributed.run) for bench/goodput.sh,
# mended for Debian's torch 1.13 under Python 3.11, where enum.Flag no longer
# yields Std.NONE: every torchrun fails in to_map() with "'NoneType' object has
# no attribute 'get'" (--redirects and --tee parse to None). Nothing else changes.
import sys

import torch.distributed.elastic.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.api import Std

_to_map = mp.to_map
mp.to_map = lambda value, n: _to_map(Std.NONE if value is None else value, n)

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
