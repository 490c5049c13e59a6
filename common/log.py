"""Logging and progress that read well both on a terminal and in a `tail -f` of a nohup log."""
import logging
import sys
import time

from tqdm import tqdm


def setup_logging(stage_name):
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, force=True,
                        format=f"%(asctime)s [{stage_name}] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    return logging.getLogger(stage_name)


def fmt_duration(seconds):
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """tqdm on a terminal; otherwise one plain line every `interval` seconds with rate and ETA."""

    def __init__(self, total, desc, unit="samples", interval=30.0, log=None, extra_unit=None):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.extra_unit = extra_unit  # e.g. "tokens": a second counter whose rate is reported too
        self.done = self.extra = 0
        self.start = self.last = time.time()
        self.log = log or logging.getLogger()
        self.bar = tqdm(total=total, desc=desc, unit=unit[:-1] if unit.endswith("s") else unit) \
            if sys.stderr.isatty() else None

    def update(self, n=1, extra=0):
        self.done += n
        self.extra += extra
        if self.bar:
            self.bar.update(n)
            if self.extra_unit:
                self.bar.set_postfix_str(f"{self.extra / max(time.time() - self.start, 1e-9):.0f} {self.extra_unit}/s")
        elif time.time() - self.last >= self.interval:
            self.last = time.time()
            self.log.info(self.line())

    def line(self):
        elapsed = time.time() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct:.1f}%), {rate:.2f} {self.unit}/s, "
                f"elapsed {fmt_duration(elapsed)}, ETA {fmt_duration(eta) if eta == eta else '?'}")
        if self.extra_unit:
            text += f", {self.extra / max(elapsed, 1e-9):.0f} {self.extra_unit}/s"
        return text

    def close(self):
        if self.bar:
            self.bar.close()
        self.log.info(self.line().replace("ETA 0:00:00", "done"))
