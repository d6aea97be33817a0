"""The toolkit's messages as :mod:`logging` records, so a user can silence, filter or redirect them.

Every module logs to a child of the ``retention`` logger (``logging.getLogger(__name__)``). That logger gets one
handler of its own (as transformers' does), which writes ``[retention] message`` (``[eval]`` for the eval harness)
to the *current* ``sys.stdout`` through ``tqdm.write``, so a message never tears a progress bar; warnings read
``[retention] warning: ...``. It does not propagate to the root logger, so ``logging.basicConfig`` prints nothing
twice. To quiet the toolkit::

    import logging
    logging.getLogger("retention").setLevel(logging.WARNING)   # warnings only
    logging.getLogger("retention").handlers.clear()            # then add your own handler to redirect
"""

from __future__ import annotations

import logging
import sys

ROOT = "retention"


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        tag = "eval" if record.name.startswith(f"{ROOT}.eval") else ROOT
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"[{tag}] {level}{record.getMessage()}"


class _TqdmStdout(logging.Handler):
    """Writes to whatever ``sys.stdout`` is at the time (a test's capture, a redirected stream), above any bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
            sys.stdout.flush()
        except Exception:  # a closed stream must not take the run down
            self.handleError(record)


def _install() -> logging.Logger:
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _TqdmStdout) for h in logger.handlers):
        handler = _TqdmStdout()
        handler.setFormatter(_Format())
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


_install()
