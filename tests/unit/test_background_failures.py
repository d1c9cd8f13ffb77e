"""How the daemon's background tasks end up in the journal: one line each; an entry that went away
under its fill (evicted by an operator or a reload) is said at info, not as the daemon's error."""

from __future__ import annotations

import asyncio
import logging

import pytest

from wcd.errors import LoadFailed, NotFound
from wcd.server import _log_failure


@pytest.mark.parametrize(("error", "level"), [
    (NotFound("loading m was cancelled: the entry was evicted"), logging.INFO),
    (LoadFailed("loading m failed: /w/m changed while it was being loaded"), logging.ERROR),
])
def test_a_failed_background_task_is_one_line_at_its_level(error: Exception, level: int,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise error

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(fails())
        await asyncio.wait([task])
        _log_failure(task)

    caplog.set_level(logging.INFO, logger="wcd")
    asyncio.run(main())
    [record] = caplog.records
    assert (record.levelno, record.getMessage(), record.exc_info) == (level, error.message, None)  # type: ignore[attr-defined]
