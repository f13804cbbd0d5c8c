"""Instruments for the teaching notebooks: see where a forward pass spends its time.

Notebook 06 times prefetch: a forward over weights read from a disk, with and without the
next block read while the current one computes. These are its instruments, tested like the
rest of bigviz so that a notebook's numbers come from code that is checked:

* :class:`~bigviz.teaching.slow_disk.SlowDisk`: a checkpoint read as if from a device of a
  given bandwidth (a cloud volume, a hard disk), so that a read costs time whatever the page
  cache and the CPU load, and every read is logged (which thread, when, how many bytes).
* :class:`~bigviz.teaching.timeline.ForwardTimeline`: when each block was called, had its
  weights and finished, and how long the computing thread was blocked (neither on a core nor
  waiting for one), with :func:`~bigviz.teaching.timeline.draw_timelines` to draw them.
* :func:`~bigviz.teaching.schedule.draw_schedules`: notebook 09's pipeline bubble, each
  stage's work and idle slots for a number of micro-batches.
* :mod:`bigviz.teaching.machine`: the Linux facts those need (``/proc`` read counters and
  scheduler times, the kernel's read-ahead of the disk, dropping a checkpoint's pages from the
  page cache); elsewhere they answer "unknown" instead of failing.

Nothing here is needed to plan or run a model; ``import bigviz`` does not load it.
"""

from __future__ import annotations

from bigviz.teaching.machine import (
    can_drop_pages,
    disk_read_bytes,
    drop_pages,
    mount_of,
    read_ahead_kib,
    thread_times,
)
from bigviz.teaching.schedule import draw_schedules, schedule
from bigviz.teaching.slow_disk import Read, SlowDisk
from bigviz.teaching.timeline import BlockMarks, ForwardTimeline, draw_timelines

__all__ = [
    "SlowDisk",
    "Read",
    "ForwardTimeline",
    "BlockMarks",
    "draw_timelines",
    "schedule",
    "draw_schedules",
    "disk_read_bytes",
    "thread_times",
    "mount_of",
    "read_ahead_kib",
    "can_drop_pages",
    "drop_pages",
]
