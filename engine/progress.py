"""Progress bars that suit a terminal and a log file alike."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(**kwargs) -> tqdm:
    """A tqdm bar that redraws at most twice a second on a terminal and every 30 s into a log (a GPU run's output,
    a CI job's, `nohup`), where each redraw is another line. Callers pass `refresh=False` to set_postfix, which would
    otherwise redraw on every call, past the rate limit."""
    return tqdm(mininterval=0.5 if sys.stderr.isatty() else 30, **kwargs)
