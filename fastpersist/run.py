"""``python -m fastpersist.run [options] script.py ARGS``: the script, with torch.save/torch.load/safetensors through fastpersist.

The launcher of :mod:`fastpersist.cli.run` (``fastpersist run``), for
``torchrun -m fastpersist.run`` and ``accelerate launch -m fastpersist.run``.
The function is ``fastpersist.patch``; this module has another name so that
importing it never hides that function.
"""

import sys

from fastpersist.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
