"""The driver's Ray: joining a cluster or starting an embedded one of our own, and keeping Ray's own lines
(its log records, the cluster's error messages) off the console."""

from __future__ import annotations

import contextlib
import logging
import os


def init_ray(address: str | None, level: str = "warning", verbose: bool = False) -> bool:
    """Join the cluster at `address`, or start an embedded local Ray of our own (never a cluster that happens to
    run on this machine: another job's); True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, logging_level=getattr(logging, level.upper()), log_to_driver=verbose)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), **kwargs)
    return True


@contextlib.contextmanager
def ray_log_to(path: str | None):
    """Send Ray's own lines in this process to the file `path`, created on the first line, instead of the
    console: its log records (warnings such as the token-authentication notice) and the cluster's error
    messages it prints as "(raylet) ..." (a task retried after its node died, a worker killed); None: leave
    them."""
    if not path:
        yield
        return
    from ray._private import worker as ray_worker

    ray_logger = logging.getLogger("ray")
    before, printer = ray_logger.handlers[:], getattr(ray_worker, "print_to_stdstream", None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_logger.handlers = [handler]

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            handler.handle(ray_logger.makeRecord("ray", logging.WARNING, __file__, 0, "(%s) %s",
                                                 (data.get("pid", "ray"), line), None))

    if printer is not None:  # Ray's error listener prints through this module global, whatever log_to_driver says
        ray_worker.print_to_stdstream = to_log
    try:
        yield
    finally:
        ray_logger.handlers = before
        if printer is not None:
            ray_worker.print_to_stdstream = printer
        handler.close()
